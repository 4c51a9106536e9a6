"""`python -m tui [--url URL] [--api-key KEY] [--replay FILE] [--interval SECONDS]`."""

from tui.app import main

raise SystemExit(main())
