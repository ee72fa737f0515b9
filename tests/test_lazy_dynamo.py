"""A compile that needs no dynamo never imports torch._dynamo; once something does, torch's wrappers behave as
torch wrote them."""

from __future__ import annotations

import json
import subprocess
import textwrap

from conftest import PYTHON, REPO

SCRIPT = textwrap.dedent("""
    import json, sys
    from pipec.cli import main
    code = main(["compile", "--model", "pipec.examples.gpt:build", "--model-arg",
                 "layers=2, dim=16, heads=2, vocab=32, seq=8", "--input", "tokens: int64[4, 8]",
                 "--ranks", "2", "--microbatches", "2", "--costs", "unit", "-o", sys.argv[1]])
    after_compile = "torch._dynamo" in sys.modules
    import torch
    calls = []
    def kernel(x):
        calls.append(x)
        return x + 1
    wrapped = torch._disable_dynamo(kernel)   # a wrapper torch makes after the front end's import
    before = (wrapped(1), hasattr(kernel, "__dynamo_disable"))
    import torch._dynamo
    after = (wrapped(2), hasattr(kernel, "__dynamo_disable"))
    meta = list(torch.ones(3, 3, device="meta").tril().shape)   # one torch made at its import, dynamo imported
    print(json.dumps(dict(code=code, after_compile=after_compile, before=before, after=after, calls=calls,
                          meta=meta)))
""")


def test_a_compile_on_meta_never_imports_dynamo_and_torchs_wrappers_still_disable_it_once_imported(tmp_path):
    out = subprocess.run([PYTHON, "-c", SCRIPT, str(tmp_path / "plan.json")], cwd=REPO / "tests", capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["code"] == 0 and (tmp_path / "plan.json").exists()
    assert got["after_compile"] is False
    assert got["before"] == [2, False]  # called straight through: nothing to disable
    assert got["after"] == [3, True]  # torch's own path: dynamo.disable cached on the kernel
    assert got["calls"] == [1, 2] and got["meta"] == [3, 3]
