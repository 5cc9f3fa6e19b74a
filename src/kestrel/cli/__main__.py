"""``python -m kestrel.cli``, as ``python -m kestrel``."""

from kestrel.cli import main

raise SystemExit(main())
