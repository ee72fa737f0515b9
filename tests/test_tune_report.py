"""What ``pipec tune`` prints: tables within 80 columns, and reasons for its microbatches and chunks."""

from __future__ import annotations

import re

SMALL = '''model "pipec.examples.gpt:build" (layers=4, dim=32, heads=2, vocab=64, seq=16)
input tokens: int64[8, 16]
costs flops
peak_flops 1e12
pp 4
device_memory 1MiB
'''


def test_tune_prints_within_80_columns_and_says_why_these_microbatches(cli, tmp_path):
    (tmp_path / "small.pipe").write_text(SMALL)
    out = cli("tune", "small.pipe", "--devices", "4", "--keep", "pp", "-o", "t.json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    head = next(i for i, line in enumerate(lines) if line.startswith("layout"))
    assert lines[head].split() == ["layout", "schedule", "v", "M", "step", "MFU", "bubble", "peak"], lines[head]
    assert any(line.startswith("every row: partition flops, recompute none") for line in lines)
    why = " ".join(out.stdout.split("why this one:", 1)[1].split("as schedule-file lines:", 1)[0].split())
    m = re.search(r"with (\d+) microbatches(?: x \d+ chunks)?: predicted bubble [\d.]+% \([\d.]+ us of [\d.]+ us\), "
                  r"[\d.]+ us of compute per microbatch per rank", why)
    assert m, why
    assert re.search(rf"M {m.group(1)}: M \d+ (is slower|ties at)", why), why
    assert "fewer microbatches leave more of the step idle (the bubble); more pay each microbatch's fixed cost" in why
