"""``python -m hyper_parallel.data.direct_token {write,toy,check} ...``"""

from hyper_parallel.data.direct_token.cli import main

raise SystemExit(main())
