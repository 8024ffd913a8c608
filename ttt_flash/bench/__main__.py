"""``python -m ttt_flash.bench ...``: the same as ``ttt-flash bench ...``."""

from .chain import main

raise SystemExit(main())
