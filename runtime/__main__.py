"""``torchrun --nproc-per-node N -m pipec.runtime plan.json [flags]``: one rank of a run."""

from pipec.runtime.launch import main

raise SystemExit(main())
