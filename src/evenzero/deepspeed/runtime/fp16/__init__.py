"""`deepspeed.runtime.fp16`: DeepSpeed's stage-0 half-precision optimizers. evenzero runs
half precision only inside its ZeRO-1/2 optimizer, so the classes import (for isinstance
checks) and refuse to be built."""
