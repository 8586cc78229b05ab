"""torchrun entry points, installed as ``distwgrad.launch``; ``distwgrad.launch.train`` is the training job."""
