"""One image on several processes: CFG-parallel and Ulysses sequence parallel over torch.distributed.

The ranks form a mesh  world = dp x cfg x ulysses  (ulysses fastest: rank = (dp_i * cfg + cfg_i) * ulysses + u_i).
One image group (cfg x ulysses ranks) denoises one image (batch); dp groups render different prompts.

CFG-parallel (cfg = 2): cfg rank 0 runs the prompt, rank 1 the negative prompt; one all-gather per step hands both
noise predictions to both, and each combines and steps the same latents (the pipeline does this).

Ulysses (ulysses = P ranks, P dividing the head count): each rank holds a contiguous slice of the image tokens and
one of the text tokens, so every token-local kernel of the blocks (norms, modulation, FP8 GEMMs, RoPE) runs
unchanged on the local rows. The BF16 GEMMs around the blocks (img_in, txt_in, proj_out: a small share of the work)
run on all rows on every rank instead, the image rows gathered before proj_out: cuBLAS picks a BF16 kernel by the
row count, and half a text's rows rounded otherwise than one GPU (rowwise FP8 GEMM rows do not depend on it).
Around attention one all-to-all turns the local [B, n_r, H, D] rows of Q, K and V (stacked) into all S rows
of H/P heads, and one turns the output back. Why split the text too rather than replicate it: replicated text
would run its GEMMs on every rank (P times the text work) and would still have to take part in attention as
keys; split, every rank does the same work within one token. Slices are as even as possible (sizes differ by at
most one), so a token count that P does not divide needs no padding: the all-to-alls take uneven split sizes.
The gathered rows are reordered to [all image, all text], the single-GPU layout (attention.py), so a right-padded
text's padding stays at the end of each sample and `seqused_k` masks it as on one GPU; a text shorter than P
tokens is padded (masked) to P so that every rank holds at least one text token.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

PARALLEL_ADVICE = ("launch with `torchrun --nproc_per_node N ...` (or accelerate launch) and call "
                   "torch.distributed.init_process_group() before building the pipeline")


def even_sizes(n: int, parts: int) -> list[int]:
    """n items in `parts` contiguous slices, sizes differing by at most one (larger first)."""
    return [n // parts + (r < n % parts) for r in range(parts)]


@dataclass(frozen=True)
class MeshShape:
    """Degrees of the mesh, checked against a world size and a head count (no process group needed)."""

    cfg: int
    ulysses: int
    world: int

    @property
    def group_size(self) -> int:
        return self.cfg * self.ulysses

    @property
    def dp(self) -> int:
        return self.world // self.group_size

    @classmethod
    def resolve(cls, parallel: str, ulysses_degree: int, world: int, heads: int | None) -> "MeshShape":
        """parallel: "cfg" | "ulysses" | "cfg,ulysses"; ulysses_degree 0 = every rank CFG leaves (no dp)."""
        cfg = 2 if "cfg" in parallel.split(",") else 1
        if "ulysses" in parallel.split(","):
            ulysses = ulysses_degree or world // cfg
            if ulysses < 2:
                raise ValueError(f"parallel={parallel!r} with ulysses degree {ulysses} (world size {world}): Ulysses "
                                 "needs at least 2 ranks per image")
        elif ulysses_degree not in (0, 1):
            raise ValueError(f"ulysses_degree={ulysses_degree} without parallel='ulysses' (parallel={parallel!r})")
        else:
            ulysses = 1
        if world % (cfg * ulysses):
            raise ValueError(f"parallel={parallel!r}: cfg degree {cfg} x ulysses degree {ulysses} = {cfg * ulysses} "
                             f"does not divide the world size {world}")
        if heads is not None and heads % ulysses:
            raise ValueError(f"ulysses degree {ulysses} does not divide the transformer's {heads} attention heads; "
                             f"allowed: a divisor of {heads}")
        return cls(cfg, ulysses, world)

    @classmethod
    def of_group(cls, parallel: str, ulysses_degree: int, heads: int | None) -> "MeshShape":
        """resolve() on the initialised default process group's world size; RuntimeError without one."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"parallel={parallel!r} needs an initialised torch.distributed process group: "
                               + PARALLEL_ADVICE)
        return cls.resolve(parallel, ulysses_degree, dist.get_world_size(), heads)


class ParallelMesh:
    """The process groups of a MeshShape on the initialised default group. Every rank builds every group (in the
    same order), as torch.distributed.new_group requires."""

    def __init__(self, shape: MeshShape):
        self.shape = shape
        self.rank = dist.get_rank()
        size, u = shape.group_size, shape.ulysses
        self.dp_rank, in_group = divmod(self.rank, size)
        self.cfg_rank, self.ulysses_rank = divmod(in_group, u)
        self.image_group = self.cfg_group = self.ulysses_group = None
        for d in range(shape.dp):
            base = d * size
            ranks = list(range(base, base + size))
            group = dist.new_group(ranks)
            if d == self.dp_rank:
                self.image_group, self.image_leader = group, base
            for c in range(shape.cfg):
                group = dist.new_group(ranks[c * u:(c + 1) * u])
                if (d, c) == (self.dp_rank, self.cfg_rank):
                    self.ulysses_group = group
            for j in range(u):
                group = dist.new_group(ranks[j::u])
                if (d, j) == (self.dp_rank, self.ulysses_rank):
                    self.cfg_group = group
        # one Ulysses group for the pipeline's life: its layouts (index tensors) are built once per shape
        self._ulysses = Ulysses(self.ulysses_group, u, self.ulysses_rank) if u > 1 else None

    @classmethod
    def build(cls, parallel: str, ulysses_degree: int, heads: int | None) -> "ParallelMesh":
        return cls(MeshShape.of_group(parallel, ulysses_degree, heads))

    @property
    def is_image_leader(self) -> bool:
        """The rank that writes its image group's outputs (the CLI's)."""
        return self.rank == self.image_leader

    def share(self, value):
        """The image group leader's (picklable) value on every rank of the group."""
        box = [value]
        dist.broadcast_object_list(box, src=self.image_leader, group=self.image_group)
        return box[0]

    def applied(self) -> list[str]:
        return ((["parallel:cfg2"] if self.shape.cfg > 1 else [])
                + ([f"parallel:ulysses{self.shape.ulysses}"] if self.shape.ulysses > 1 else []))

    def ulysses(self) -> "Ulysses | None":
        return self._ulysses

    def broadcast_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The image group's leader's starting latents on every rank of the group (a generator=None call draws
        different noise on each rank)."""
        if self.shape.group_size > 1:
            dist.broadcast(latents, src=self.image_leader, group=self.image_group)
        return latents

    def gather_cfg(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cond, uncond) noise predictions from this rank's one: one all-gather in the CFG pair."""
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine.contiguous(), group=self.cfg_group)
        return both[0], both[1]


class UlyssesPlan:
    """Where one forward's tokens live: rank r holds image tokens img_slices[r] and text tokens txt_slices[r]."""

    def __init__(self, img_len: int, txt_len: int, degree: int, rank: int, device: torch.device):
        if img_len < degree or txt_len < degree:
            raise ValueError(f"Ulysses over {degree} ranks needs at least {degree} image and text tokens, got "
                             f"{img_len} and {txt_len}")
        img_sizes, txt_sizes = even_sizes(img_len, degree), even_sizes(txt_len, degree)
        self.sizes = [i + t for i, t in zip(img_sizes, txt_sizes)]  # local rows per rank
        img_starts = [sum(img_sizes[:r]) for r in range(degree)]
        txt_starts = [sum(txt_sizes[:r]) for r in range(degree)]
        self.img = slice(img_starts[rank], img_starts[rank] + img_sizes[rank])
        self.txt = slice(txt_starts[rank], txt_starts[rank] + txt_sizes[rank])
        # rows as gathered (rank by rank, each [its image | its text]) -> [all image | all text], and back
        starts = [sum(self.sizes[:r]) for r in range(degree)]
        order = ([s + i for r, s in enumerate(starts) for i in range(img_sizes[r])]
                 + [s + img_sizes[r] + i for r, s in enumerate(starts) for i in range(txt_sizes[r])])
        self.to_joint = torch.tensor(order, device=device)
        self.to_gathered = torch.argsort(self.to_joint)
        self.img_sizes, self.degree, self.local_len = img_sizes, degree, self.sizes[rank]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The index tensors the all-to-alls read (a CUDA graph of a forward keeps them: cuda_graph.read_by_graph)."""
        return self.to_joint, self.to_gathered


class Ulysses:
    """The all-to-alls of one Ulysses group (its process group, degree P, this rank's index in it), and the layouts
    of the shapes it has run (a CUDA graph of a forward also keeps the one it read: UlyssesPlan.tensors)."""

    def __init__(self, group, degree: int, rank: int):
        self.group, self.degree, self.rank = group, degree, rank
        self._plans: dict = {}

    def plan(self, img_len: int, txt_len: int, device: torch.device) -> UlyssesPlan:
        key = (img_len, txt_len, str(device))
        if key not in self._plans:
            self._plans[key] = UlyssesPlan(img_len, txt_len, self.degree, self.rank, device)
        return self._plans[key]

    def to_heads(self, qkv: torch.Tensor, plan: UlyssesPlan) -> torch.Tensor:
        """qkv [3, B, n_local, H, D] (this rank's rows, [image | text]) -> [3, B, S, H/P, D], rows [image | text]."""
        three, batch, n, heads, dim = qkv.shape
        p = self.degree
        send = qkv.view(three, batch, n, p, heads // p, dim).permute(3, 2, 0, 1, 4, 5).contiguous()  # [P, n, 3, B, h, D]
        recv = qkv.new_empty(sum(plan.sizes), three, batch, heads // p, dim)
        dist.all_to_all_single(recv, send.view(p * n, three, batch, heads // p, dim), output_split_sizes=plan.sizes,
                               input_split_sizes=[n] * p, group=self.group)
        return recv.permute(1, 2, 0, 3, 4)[:, :, plan.to_joint].contiguous()  # reordered [image | text]

    def to_rows(self, o: torch.Tensor, plan: UlyssesPlan) -> torch.Tensor:
        """o [B, S, H/P, D] (rows [image | text]) -> this rank's rows of all heads [B, n_local, H, D]."""
        batch, _, h, dim = o.shape
        p, n = self.degree, plan.local_len
        send = o.permute(1, 0, 2, 3)[plan.to_gathered].contiguous()  # [S, B, h, D], rank by rank
        recv = o.new_empty(p * n, batch, h, dim)
        dist.all_to_all_single(recv, send, output_split_sizes=[n] * p, input_split_sizes=plan.sizes,
                               group=self.group)
        return recv.view(p, n, batch, h, dim).permute(2, 1, 0, 3, 4).reshape(batch, n, p * h, dim)

    def gather_image(self, x: torch.Tensor, plan: UlyssesPlan) -> torch.Tensor:
        """This rank's image rows [B, n_img, C] -> all of them [B, L_img, C] on every rank of the group."""
        longest = plan.img_sizes[0]
        padded = x.new_zeros(x.shape[0], longest, x.shape[2])
        padded[:, :x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(self.degree)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:, :size] for part, size in zip(parts, plan.img_sizes)], dim=1)
