"""For tests/test_megatron_layout.py: on every rank, for several layouts, megatron-core's initialize_model_parallel
(gloo, CPU), then hyperpodrun's megatron_layout() read from it; the replica group hyperpodrun's map gives this rank
is compared with the one Megatron's own groups give (the rank's data x context parallel group cut into
contiguous instances, as Megatron's partial distributed optimizer cuts it). OUT_DIR/rank<r>.txt: one line per
layout, "ok <fingerprint>" or "bad ...". LAYOUTS: ';'-separated tp,pp,cp,instances,order."""
import os
import warnings

warnings.simplefilter("ignore")
import torch.distributed as dist   # noqa: E402
from megatron.core import parallel_state as ps   # noqa: E402

from hyperpodrun.integrations.megatron_layout import megatron_layout   # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
lines = []
for spec in os.environ["LAYOUTS"].split(";"):
    tp, pp, cp, n, order = spec.split(",")
    ps.initialize_model_parallel(tensor_model_parallel_size=int(tp), pipeline_model_parallel_size=int(pp),
                                 context_parallel_size=int(cp), num_distributed_optimizer_instances=int(n),
                                 order=order, create_gloo_process_groups=False)
    layout = megatron_layout()
    theirs = dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True))
    intra = len(theirs) // int(n)
    j = theirs.index(rank) % intra
    megatrons = sorted(theirs[j + i * intra] for i in range(int(n)))
    ours = next(g for g in layout.groups(world) if rank in g)
    lines.append(f"ok {layout.fingerprint(world)}" if ours == megatrons else f"bad {spec}: {ours} != {megatrons}")
    ps.destroy_model_parallel()
with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.txt"), "w") as fh:
    fh.write("\n".join(lines) + "\n")
dist.destroy_process_group()
