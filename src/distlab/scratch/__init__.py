"""The mechanisms rebuilt by hand, each tested equal to PyTorch's own: ring all-reduce
(``collectives``), ``nn.DataParallel`` (``data_parallel``), DDP in three steps
(``ddp``), FSDP with flat shards (``fsdp``, its unit policy in ``fsdp_units``), a
halving-doubling all-reduce (``halving_doubling``) and a SyncBatchNorm that runs on gloo
(``sync_batchnorm``; torch's needs a GPU), and DistributedSampler's rule with its deal
drawn (``sampler``). Only the mechanism lives here; the
experiments that run it are in ``distlab.chapters``. May import the training
library only."""
