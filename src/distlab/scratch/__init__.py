"""The mechanisms rebuilt by hand, each tested equal to PyTorch's own: ring all-reduce
(``collectives``), ``nn.DataParallel`` (``data_parallel``), DDP in three steps (``ddp``) and FSDP
with flat shards (``fsdp``). Only the mechanism lives here; the experiments that run it are in
``distlab.chapters``. May import the training library only."""
