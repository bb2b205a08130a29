"""`python -m qwen_image_fast render|compare ...` (also what torchrun / accelerate launch -m run)."""

import sys

from .cli import main

sys.exit(main())
