"""Data parallelism over a per-step quorum of replica groups (live recovery, chapter 10, section 6):
``quorum_ddp`` -- the quorum-averaged gradient and DDP over it; ``local_sgd`` -- LocalSGD / DiLoCo
whose outer step averages over the groups present. The quorum itself is ``minidist.resilience.live``."""
