"""``python -m hyper_parallel.data.vision_language {write,toy,check,index} ...``"""

from hyper_parallel.data.vision_language.cli import main

raise SystemExit(main())
