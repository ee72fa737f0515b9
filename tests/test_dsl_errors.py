"""Golden error messages: the exact text a user sees for common mistakes.

Each case is a schedule file with one mistake and the full rendered error
(``file:line:col: error: ...``, the source line, the caret, the hints), as
`pipec check` prints it: the language's own errors, and the compiler
driver's (a schedule's rules, an order's invariants) located by the
boundary. A wording change is deliberate: update the text here with it.
"""

from __future__ import annotations

import pytest

from pipec.compiler.driver import compile_spec
from pipec.dsl import DSLError, parse_spec


def check(text: str) -> None:
    """Parse, resolve and compile (the schedule alone) ``text`` as job.pipe."""
    compile_spec(parse_spec(text, filename="job.pipe"), trace=False)

GOLDEN = [
    pytest.param(
        'schedule 1f1b\nmicrobatchs 8\n',
        """\
job.pipe:2:1: error: unknown key 'microbatchs'
    microbatchs 8
    ^~~~~~~~~~~
did you mean 'microbatches'?
""",
        id='misspelt_key',
    ),
    pytest.param(
        'pp 4\nschedule interleaved_1fb1\n',
        """\
job.pipe:2:10: error: unknown schedule 'interleaved_1fb1'
    schedule interleaved_1fb1
             ^~~~~~~~~~~~~~~~
did you mean 'interleaved_1f1b'?
""",
        id='misspelt_schedule',
    ),
    pytest.param(
        'pp 4\nschedule dualpipev\n',
        """\
job.pipe:2:10: error: schedule 'dualpipev' is torch's ScheduleDualPipeV (DeepSeek-V3's DualPipe as a V of 2 chunks per rank, forward and backward overlapped), which pipec does not have yet
    schedule dualpipev
             ^~~~~~~~~
the nearest pipec has: zbv; pipec's schedules are: gpipe, 1f1b, interleaved_1f1b, looped_bfs, zb_h1, zbv, interleaved_zb
""",
        id='torch_schedule_pipec_lacks',
    ),
    pytest.param(
        'pp 4\nschedule ScheduleZBVZeroBubble\n',
        """\
job.pipe:2:10: error: unknown schedule 'ScheduleZBVZeroBubble'; it is torch's name for pipec's zbv
    schedule ScheduleZBVZeroBubble
             ^~~~~~~~~~~~~~~~~~~~~
write: schedule zbv
""",
        id='torch_class_name',
    ),
    pytest.param(
        'schedule zbv\npp 4\nvirtual 3\n',
        """\
job.pipe:3:9: error: zbv needs exactly 2 chunks per rank, got virtual 3; use virtual 2
    virtual 3
            ^
""",
        id='zbv_chunks',
    ),
    pytest.param(
        'pp = 4\n',
        """\
job.pipe:1:4: error: a key takes its value after a space, without '='
    pp = 4
       ^
write it as `pp value`
""",
        id='equals_after_key',
    ),
    pytest.param(
        'microbatches: 8\n',
        """\
job.pipe:1:13: error: a key takes its value after a space, without ':'
    microbatches: 8
                ^
write it as `microbatches value`
""",
        id='colon_after_key',
    ),
    pytest.param(
        'pp 4\nschedule\n',
        """\
job.pipe:2:9: error: 'schedule' needs a value
    schedule
            ^
for example: schedule interleaved_1f1b
""",
        id='missing_value',
    ),
    pytest.param(
        'pp four\n',
        """\
job.pipe:1:4: error: pp needs a whole number >= 1 and <= 4096, got 'four'
    pp four
       ^~~~
""",
        id='word_for_number',
    ),
    pytest.param(
        'pp 5000\n',
        """\
job.pipe:1:4: error: pp 5000 is beyond pipec's limit of 4096 pipeline ranks
    pp 5000
       ^~~~
""",
        id='beyond_limit',
    ),
    pytest.param(
        'microbatches 8.5\n',
        """\
job.pipe:1:14: error: microbatches needs a whole number, got 8.5
    microbatches 8.5
                 ^~~
""",
        id='fraction',
    ),
    pytest.param(
        'device_memory 80Gb\n',
        """\
job.pipe:1:15: error: unknown unit 'Gb' for a size
    device_memory 80Gb
                  ^~~~
did you mean 'GB'?
""",
        id='misspelt_unit',
    ),
    pytest.param(
        'device_memory 10us\n',
        """\
job.pipe:1:15: error: device_memory needs a size such as 80GB, got 10us, a time
    device_memory 10us
                  ^~~~
""",
        id='wrong_unit_kind',
    ),
    pytest.param(
        'pp 4\ndp 2\npp 8\n',
        """\
job.pipe:3:1: error: 'pp' is set twice
    pp 8
    ^~
it is first set at line 1; remove one
""",
        id='set_twice',
    ),
    pytest.param(
        'model pipec.examples.gpt:build\n',
        """\
job.pipe:1:25: error: a 'module:function' target must be quoted
    model pipec.examples.gpt:build
                            ^
write it in double quotes: "pkg.module:function"
""",
        id='unquoted_model',
    ),
    pytest.param(
        'model "pipec.examples.gpt:build"\ninput tokens int64[16, 128]\n',
        """\
job.pipe:2:14: error: unknown key 'int64'
    input tokens int64[16, 128]
                 ^~~~~
an input is written NAME: DTYPE[DIMS]; is the ':' after the input's name missing?
""",
        id='input_without_colon',
    ),
    pytest.param(
        'model "pipec.examples.gpt:build"\ninput tokens: int46[16, 128]\n',
        """\
job.pipe:2:15: error: unknown dtype 'int46'
    input tokens: int46[16, 128]
                  ^~~~~
did you mean 'int64'?
""",
        id='misspelt_dtype',
    ),
    pytest.param(
        'model "pipec.examples.gpt:build" (layers=8)\n',
        """\
job.pipe:1:7: error: a model needs an example input to be traced
    model "pipec.examples.gpt:build" (layers=8)
          ^~~~~~~~~~~~~~~~~~~~~~~~~~
add the input of one dp replica's batch, such as: input tokens: int64[16, 128]
""",
        id='model_without_input',
    ),
    pytest.param(
        'model "pipec.examples.gpt:build"\ninput tokens: int64[16, 128]\nmicrobatches 6\n',
        """\
job.pipe:3:14: error: microbatches 6 does not divide the input's batch of 16
    microbatches 6
                 ^
use one of 1, 2, 4, 8, 16
""",
        id='batch_not_divisible',
    ),
    pytest.param(
        'pp 4\nvirtual 2\nstages 6\n',
        """\
job.pipe:3:8: error: stages 6 must equal pp x virtual = 4 x 2 = 8
    stages 6
           ^
give stages or virtual; the other follows
""",
        id='stages_mismatch',
    ),
    pytest.param(
        'pp 4\npartition split before blocks.2, blocks.4\n',
        """\
job.pipe:2:11: error: 2 split points make 3 stages, but there are 4
    partition split before blocks.2, blocks.4
              ^~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
give 3 split points
""",
        id='split_count',
    ),
    pytest.param(
        'optimizer adamw(beta=(0.9, 0.95))\n',
        """\
job.pipe:1:17: error: unknown adamw setting 'beta'
    optimizer adamw(beta=(0.9, 0.95))
                    ^~~~
did you mean 'betas'?
""",
        id='optimizer_setting',
    ),
    pytest.param(
        'schedule interleaved_1f1b\npp 4\nmicrobatches 9\n',
        """\
job.pipe:3:14: error: interleaved_1f1b needs the microbatches to be a multiple of its rounds, max(1, M // P) = 2 (torch's ScheduleInterleaved1F1B rule), got microbatches 9 with pp 4; use microbatches 8 or 10
    microbatches 9
                 ^
""",
        id='interleaved_rule',
    ),
    pytest.param(
        'schedule 1f1b\npolicy 1f1b\n',
        """\
job.pipe:2:8: error: schedule and policy both choose the schedule
    policy 1f1b
           ^~~~
keep one: `schedule ...` or `policy ...`
""",
        id='schedule_and_policy',
    ),
    pytest.param(
        'policy (warmup=ranks - 1 - rnk)\n',
        """\
job.pipe:1:28: error: unknown name 'rnk' in an expression
    policy (warmup=ranks - 1 - rnk)
                               ^~~
did you mean 'rank'?
""",
        id='policy_unknown_name',
    ),
    pytest.param(
        'policy (warmup=M / 2)\n',
        """\
job.pipe:1:16: error: '/' is not integer division
    policy (warmup=M / 2)
                   ^~~~~
use // (floor division)
""",
        id='policy_true_division',
    ),
    pytest.param(
        'order\n  rank 0 F0.0 B0.0\n',
        """\
job.pipe:2:10: error: a rank clause needs ':' before its actions
      rank 0 F0.0 B0.0
             ^
write `rank 0: F0.0 F0.1 ...`
""",
        id='order_missing_colon',
    ),
    pytest.param(
        'order\n  rank 0: B0.0 F0.0\n',
        """\
job.pipe:2:11: error: invalid order: rank 0, action 0 (B0.0): backward before its forward
      rank 0: B0.0 F0.0
              ^~~~
""",
        id='order_backward_first',
    ),
    pytest.param(
        'order\n  rank 0: F0.0 B0.0\n  rank 1: F0.1 B0.1\n',
        """\
job.pipe:3:11: error: stage 0 runs on rank 0 and on rank 1
      rank 1: F0.1 B0.1
              ^~~~
a stage belongs to one rank: every action of a stage goes in that rank's clause
""",
        id='order_stage_on_two_ranks',
    ),
    pytest.param(
        'optimizer adamw(betas=(0.9, 0.95)\n',
        """\
job.pipe:1:16: error: unclosed '('
    optimizer adamw(betas=(0.9, 0.95)
                   ^
close it before the end of the file
""",
        id='unclosed_paren',
    ),
    pytest.param(
        "data 'x.y:z'\n",
        """\
job.pipe:1:6: error: strings use double quotes
    data 'x.y:z'
         ^
write "..." instead of '...'
""",
        id='single_quotes',
    ),
    pytest.param(
        'placement 0 1\n',
        """\
job.pipe:1:13: error: unexpected number 1 after a complete value
    placement 0 1
                ^
join a value's parts with commas (`placement 0, 1, 1, 0`), or start a new statement with a key
""",
        id='two_values',
    ),
    pytest.param(
        'schedule zbv\nplacement loop\n',
        """\
job.pipe:2:11: error: zbv needs placement v, got loop
    placement loop
              ^~~~
use placement v, or an explicit order for another placement
""",
        id='zbv_placement',
    ),
    pytest.param(
        'costs profile\n',
        """\
job.pipe:1:7: error: costs profile needs a model to measure
    costs profile
          ^~~~~~~
use costs unit for a schedule-only plan, or add a model
""",
        id='costs_without_model',
    ),
    pytest.param(
        'pp 2\nrecompute stages 0, 5\n',
        """\
job.pipe:2:21: error: stage 5 does not exist: there are 2 stages
    recompute stages 0, 5
                        ^
stages are 0..1
""",
        id='recompute_stage',
    ),
    pytest.param(
        'seed -1\n',
        """\
job.pipe:1:6: error: seed must be at least 0, got -1
    seed -1
         ^~
""",
        id='negative',
    ),
    pytest.param(
        'lr_schedule cosine(warmup=10, min=1e-5)\n',
        """\
job.pipe:1:31: error: unknown cosine setting 'min'
    lr_schedule cosine(warmup=10, min=1e-5)
                                  ^~~
did you mean 'min_lr'?
""",
        id='lr_schedule_setting',
    ),
]


@pytest.mark.parametrize(("text", "expected"), GOLDEN)
def test_golden_error(text: str, expected: str) -> None:
    with pytest.raises(DSLError) as info:
        check(text)
    assert str(info.value) + "\n" == expected


def test_error_fields_match_the_rendering() -> None:
    with pytest.raises(DSLError) as info:
        check("pp 4\nschedule zbv\nvirtual 3\n")
    err = info.value
    assert (err.file, err.line, err.col) == ("job.pipe", 3, 9)
    assert err.source_line == "virtual 3"
    assert isinstance(err, ValueError)


def test_an_order_file_path_with_a_nul_byte_is_a_located_error():
    # os.path.getsize raises ValueError, not OSError, on such a path
    with pytest.raises(DSLError, match=r"job\.pipe:2:7: .*cannot read order file") as e:
        check("pp 2\norder \"a\x00b.csv\"\n")
    assert "embedded null byte" in str(e.value)
