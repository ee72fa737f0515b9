"""``python -m pipec`` is the ``pipec`` command."""

from pipec.runtime.cli import main

raise SystemExit(main())
