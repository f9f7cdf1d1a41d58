"""What a reader keeps using after the book: ``debug`` (Lockstep, check_replicas, the
flight-recorder analyser), ``runs`` (the run-log CLI, ``python -m distlab.tools.runs``),
the memory calculator (``memory_calculator``, ``calculator_page``) and ``dtypes`` (which
dtype each operator really ran in), ``sharding`` (an ``IterableDataset`` split by rank x
DataLoader worker), ``step_model`` (a DDP step from your numbers: the smallest batch
that hides the all-reduce) and ``allreduce_costs`` (ring, tree, in-network and
hierarchical all-reduce), drawn by ``step_figures``; ``bucket_firing`` (which bucket DDP
launched after which gradient), ``ddp_compile`` (how DDPOptimizer split a compiled
graph), ``comm_timeline`` and ``comm_bytes`` (when each bucket travelled, and how many
bytes), ``collective_lanes`` (the collectives each rank issued, from the flight
recorder), ``exact_eval`` (an exact distributed evaluation), ``collective_bytes`` (the
bytes of every c10d collective, from Python or C++), ``lr_scaling`` (learning-rate
rules), ``stragglers`` (the slow rank, from per-rank step times gathered every k steps),
``fsdp_timeline`` (FSDP2's gathered bytes after every operator, and who issued each
all-gather), ``offload`` (an activation offload hook, and a meter of what any offload
hook moves); and the planner: ``shapes`` (model sizes), ``hardware`` (GPUs and networks,
with sources), ``planner`` and ``planner_comm`` (memory and step time of a plan),
``recommend``, ``plan`` (its CLI, ``python -m distlab.tools.plan``), ``planner_page``
(its form), ``planner_check`` (against this machine's runs) and ``published_runs`` (what
it is checked against). The pictures the sharding and checkpointing pages draw from
real objects and runs live here too: ``memory_figures`` (what each rank holds per ZeRO
stage, ZeRO-1's partition and step), ``fsdp_holdings`` (the from-scratch FSDP's units
over a step), ``fsdp2_views`` (FSDP2's per-unit timeline and shards), ``who_sends``
(who sends what to whom, from counted collectives), ``label_row`` (the prefetch
timeline's labels), ``sharded_load`` and ``fsdp_labs`` (loading big models, the FSDP2
labs), ``ac_timeline``, ``ac_figures`` and ``ac_policy_figures`` (forward, recompute
and backward per policy), ``fsdp_compile_figures`` (compile's orders and its share of a
GPU step), ``dcp_files`` (which rank wrote which checkpoint file), ``prepare_tree``
(what ``accelerator.prepare`` wrapped), ``accel_config_path`` (an Accelerate config
file's path to the prepared model), ``big_model`` (Accelerate's device map for
inference), ``save_protocol`` (a checkpoint save step by step, where a kill lands, a
torchrun restart), ``preemption_timeline`` (a signal to one rank, every rank saves),
``node_map`` (two nodes, their ranks and stores) and ``triage`` (from a failure's
symptom to the tool that diagnoses it). May import the training library and
``infra``."""
