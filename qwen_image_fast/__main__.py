"""`python -m qwen_image_fast render|compare|serve ...` (also what torchrun / accelerate launch -m run)."""

import sys

from .command import main

sys.exit(main())
