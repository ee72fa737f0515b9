"""``python -m pipec`` is the ``pipec`` command."""

from pipec.cli import main

raise SystemExit(main())
