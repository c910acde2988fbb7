"""``python -m tools.fake_vllm``: see ``tools.fake_vllm.serve``."""

import sys

from tools.fake_vllm.serve import main

sys.exit(main())
