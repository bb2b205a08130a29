"""`python -m qwen_image_fast render|compare|serve ...` (also what torchrun / accelerate launch -m run)."""

import sys

from .command import exit_main

sys.exit(exit_main())
