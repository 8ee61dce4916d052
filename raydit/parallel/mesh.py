"""Process groups for ulysses x ring x cfg x replicas, built explicitly (no globals).

Rank order (docs/design.md):
    sp_index    = ring_rank * ulysses + ulysses_rank      (Ulysses groups: neighbouring ranks)
    global_rank = (replica * cfg + cfg_rank) * sp + sp_index
so a Ulysses group stays inside a node, and a ring group strides by `ulysses`. A mesh may
span a subset `ranks` of the world; the formula then gives the position in `ranks`.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from raydit.parallel.sharding import SeqLayout


@dataclass(frozen=True)
class ParallelMesh:
    """Degrees, this rank's coordinates and the process groups it belongs to.

    `rank` is the global rank (what torch.distributed calls the process); `mesh_rank` its
    position among the mesh's ranks (equal unless the mesh spans a subset of the world).
    A group is None where its degree is 1 (no communication on that axis).
    """

    ulysses: int
    ring: int
    cfg: int
    replicas: int
    rank: int
    mesh_rank: int
    ulysses_group: dist.ProcessGroup | None
    ring_group: dist.ProcessGroup | None
    sp_group: dist.ProcessGroup | None
    cfg_group: dist.ProcessGroup | None
    ring_prev: int  # global rank this rank receives K/V from
    ring_next: int  # global rank this rank sends K/V to
    # Which attention kernels sp_attention runs when given none (raydit.parallel.kernels
    # ATTENTION_MODES): "bf16" the run's own dtype; "int8" / "fp8" 8-bit QK^T; "auto" the fastest.
    attention: str = "bf16"
    # What a torch custom op (raydit.parallel.opaque) receives instead of the mesh: set at
    # creation, see `mesh_key`.
    key: int = field(default=0, init=False, compare=False, repr=False)
    # Every rank of this rank's replica (all of ulysses x ring x cfg): the group that shards
    # weights (raydit.parallel.shard_weights). None where the replica is one rank.
    replica_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", _register(self))

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def world_size(self) -> int:
        return self.sp * self.cfg * self.replicas

    @property
    def sp_index(self) -> int:
        return self.mesh_rank % self.sp

    @property
    def ulysses_rank(self) -> int:
        return self.sp_index % self.ulysses

    @property
    def ring_rank(self) -> int:
        return self.sp_index // self.ulysses

    @property
    def cfg_rank(self) -> int:
        return (self.mesh_rank // self.sp) % self.cfg

    @property
    def replica(self) -> int:
        return self.mesh_rank // (self.sp * self.cfg)


# key -> the live mesh holding it, for custom ops (weak: a dropped mesh frees its key), and
# (coordinates, n) -> key, so that keys are stable.
_MESHES: "weakref.WeakValueDictionary[int, ParallelMesh]" = weakref.WeakValueDictionary()
_KEYS: dict[tuple, int] = {}


def _register(mesh: ParallelMesh) -> int:
    """The first key of the mesh's coordinates that no live mesh holds.

    Why stable keys: a compiled graph holds the key as a constant, so a key per mesh object
    would make every re-plan recompile, and Dynamo stops compiling a block after 8 graphs (a
    worker re-planned 8 times would then run eager). A new mesh with the coordinates of a
    released one (a regroup with the same degrees) takes its key and the graphs compiled for
    it; two live meshes with the same coordinates get different keys (n = 0, 1, ...).
    """
    coords = (mesh.ulysses, mesh.ring, mesh.cfg, mesh.replicas, mesh.rank, mesh.mesh_rank, mesh.ring_prev, mesh.ring_next,
              mesh.attention)
    n = 0
    while True:
        key = _KEYS.setdefault((coords, n), len(_KEYS) + 1)
        if _MESHES.get(key) is None:
            _MESHES[key] = mesh
            return key
        n += 1


def mesh_key(mesh: ParallelMesh) -> int:
    """The integer a custom op receives for `mesh` (every mesh is registered at creation)."""
    return mesh.key


def mesh_of_key(key: int) -> ParallelMesh:
    mesh = _MESHES.get(key)
    if mesh is None:
        raise RuntimeError(f"no live ParallelMesh has key {key}; the mesh was released while a compiled model still used it")
    return mesh


def _check_degree(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {value!r} must be an integer >= 1")


def mesh_rank_of(ulysses: int, ring: int, cfg: int, replica: int, cfg_rank: int, ring_rank: int, ulysses_rank: int) -> int:
    """The mesh rank of a coordinate (the formula of docs/design.md; global when the mesh spans the world)."""
    sp = ulysses * ring
    return (replica * cfg + cfg_rank) * sp + ring_rank * ulysses + ulysses_rank


def mesh_groups(ulysses: int, ring: int = 1, cfg: int = 1, replicas: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every axis as lists of mesh ranks, in creation order (pure).

    All ranks must call new_group for every group in the same order, so the order here is
    the order of creation; each list is ascending, so a rank's position in it is its axis rank.
    """
    g = lambda rep, c, r, u: mesh_rank_of(ulysses, ring, cfg, rep, c, r, u)  # noqa: E731
    return {
        "ulysses": [
            [g(rep, c, r, u) for u in range(ulysses)]
            for rep in range(replicas) for c in range(cfg) for r in range(ring)
        ],
        "ring": [
            [g(rep, c, r, u) for r in range(ring)]
            for rep in range(replicas) for c in range(cfg) for u in range(ulysses)
        ],
        "sp": [
            [g(rep, c, r, u) for r in range(ring) for u in range(ulysses)]
            for rep in range(replicas) for c in range(cfg)
        ],
        "cfg": [
            [g(rep, c, r, u) for c in range(cfg)]
            for rep in range(replicas) for r in range(ring) for u in range(ulysses)
        ],
    }


def build_mesh(
    ulysses: int, ring: int = 1, cfg: int = 1, replicas: int = 1, ranks: list[int] | None = None,
    timeout: timedelta | None = None,
) -> ParallelMesh | None:
    """Build the mesh on the initialized default process group.

    Every rank of the default group must call this (group creation is collective). The mesh
    spans `ranks` (ascending global ranks; default: the whole world, whose size must then be
    the product of the degrees); a rank outside `ranks` gets None. With all degrees 1 the
    default group may be uninitialized (single process, no groups).

    `timeout` bounds every collective of the axis groups. Pass the default group's: torch
    gives a new group its backend's default otherwise (30 minutes for gloo), not the
    default group's, and a rank blocked on a peer that neither answers nor closes its
    connection would wait that long.
    """
    for name, value in (("ulysses_degree", ulysses), ("ring_degree", ring), ("cfg_degree", cfg), ("replicas", replicas)):
        _check_degree(name, value)
    product = ulysses * ring * cfg * replicas
    shape = f"ulysses {ulysses} x ring {ring} x cfg {cfg} x replicas {replicas} = {product} ranks"
    if not (dist.is_available() and dist.is_initialized()):
        if product != 1 or ranks not in (None, [0]):
            raise ValueError(
                f"{shape}, but torch.distributed is not initialized; call init_process_group with world_size {product}"
            )
        return ParallelMesh(1, 1, 1, 1, 0, 0, None, None, None, None, 0, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks is None:
        if product != world:
            raise ValueError(f"{shape}, but the world size is {world}; choose degrees whose product is {world}")
        ranks = list(range(world))
    ranks = list(ranks)
    if len(ranks) != product:
        raise ValueError(f"{shape}, but {len(ranks)} ranks were given ({ranks}); give exactly {product}")
    if any(not 0 <= r < world for r in ranks) or any(a >= b for a, b in zip(ranks, ranks[1:])):
        raise ValueError(f"mesh ranks {ranks} must be ascending global ranks below the world size {world}")

    # new_group is collective over the default group: every rank creates every group of
    # every axis in the same order, and keeps the one it belongs to. Groups are lists of
    # ascending mesh ranks, so group rank == axis rank (what all_gather order relies on).
    degrees = {"ulysses": ulysses, "ring": ring, "sp": ulysses * ring, "cfg": cfg}
    mine: dict[str, dist.ProcessGroup | None] = {}
    for axis, groups in mesh_groups(ulysses, ring, cfg, replicas).items():
        mine[axis] = None
        if degrees[axis] == 1:
            continue
        for members in groups:
            global_members = [ranks[m] for m in members]
            group = dist.new_group(ranks=global_members, timeout=timeout)
            if rank in global_members:
                mine[axis] = group
    # The replica's group: the sp or cfg group where it spans the whole replica, the default
    # group where the mesh is the world and one replica, else one more group per replica.
    size = ulysses * ring * cfg
    replica_group = None
    if size > 1:
        if cfg == 1 or ulysses * ring == 1:
            replica_group = mine["sp"] if cfg == 1 else mine["cfg"]
        elif replicas == 1 and len(ranks) == world:
            replica_group = dist.group.WORLD
        else:
            for rep in range(replicas):
                members = ranks[rep * size:(rep + 1) * size]
                group = dist.new_group(ranks=members, timeout=timeout)
                if rank in members:
                    replica_group = group
    if rank not in ranks:
        return None

    mesh_rank = ranks.index(rank)
    sp = ulysses * ring
    sp_index = mesh_rank % sp
    ring_rank, ulysses_rank = divmod(sp_index, ulysses)
    base = mesh_rank - sp_index
    ring_prev = ranks[base + ((ring_rank - 1) % ring) * ulysses + ulysses_rank]
    ring_next = ranks[base + ((ring_rank + 1) % ring) * ulysses + ulysses_rank]
    return ParallelMesh(
        ulysses=ulysses,
        ring=ring,
        cfg=cfg,
        replicas=replicas,
        rank=rank,
        mesh_rank=mesh_rank,
        ulysses_group=mine["ulysses"],
        ring_group=mine["ring"],
        sp_group=mine["sp"],
        cfg_group=mine["cfg"],
        ring_prev=ring_prev,
        ring_next=ring_next,
        replica_group=replica_group,
    )


def with_attention(mesh: ParallelMesh | None, attention: str) -> ParallelMesh:
    """`mesh` (None: one process, no groups) whose sp_attention runs the kernels of attention
    mode `attention`. A mesh without sequence parallelism (cfg or replicas only) gives a
    one-rank sequence mesh: its attention runs locally, through sp_attention's kernels."""
    from raydit.parallel.kernels import check_mode

    check_mode(attention)
    if mesh is None or mesh.sp == 1:
        return ParallelMesh(1, 1, 1, 1, 0, 0, None, None, None, None, 0, 0, attention)
    return dataclasses.replace(mesh, attention=attention)


def release_mesh(mesh: ParallelMesh | None) -> None:
    """Destroy the process groups `build_mesh` created for this rank (local, not collective).

    Each gloo group holds its own threads and sockets; a process that builds many meshes
    (tests and benchmarks that try every plan) must release each before the next, or its
    threads pile up by the hundred and starve the machine."""
    if mesh is None:
        return
    if _MESHES.get(mesh.key) is mesh:
        del _MESHES[mesh.key]  # its groups are gone: the key is free for the next mesh
    seen = set()
    for group in (mesh.ulysses_group, mesh.ring_group, mesh.sp_group, mesh.cfg_group, mesh.replica_group):
        if (group is None or id(group) in seen or group == dist.GroupMember.NON_GROUP_MEMBER
                or group is dist.group.WORLD):
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


def leave_default_group() -> None:
    """Destroy this process's default process group, if any, so that it can join a new one.

    torch names a process group by a per-process counter (`group_count`), and the name
    prefixes every rendezvous key. The counter goes back to 0 only when a *formed* default
    group is destroyed; a group whose rendezvous failed (a peer died mid-join) leaves it
    raised with no group to destroy. That process's next group would then be "1" while a
    fresh peer's is "0": each waits for keys the other never writes, and every retry makes
    it worse. So the counter is reset here too, with the names a failed join left
    registered (torch has no public call for either)."""
    from torch.distributed import distributed_c10d

    if dist.is_initialized():
        dist.destroy_process_group()
    else:  # what destroying a formed default group would have cleared
        distributed_c10d._unregister_all_process_groups()
    distributed_c10d._world.group_count = 0
    _MESHES.clear()  # every mesh's groups are gone: their keys are free for the next group's


def check_layout(mesh: ParallelMesh, layout: SeqLayout) -> None:
    if layout.sp != mesh.sp:
        raise ValueError(
            f"SeqLayout sp {layout.sp} does not match the mesh's ulysses {mesh.ulysses} x ring {mesh.ring} = "
            f"{mesh.sp}; build the layout with sp={mesh.sp}"
        )


def gather_sequence(x_local: Tensor, mesh: ParallelMesh, layout: SeqLayout, part: int, dim: int = 1) -> Tensor:
    """All-gather one part over the sp group and remove its padding -> the full part.

    `x_local` is either this rank's chunk of `part` (chunk_lengths[part] along `dim`) or its
    whole local sequence (local_len along `dim`), from which the part's chunk is taken.
    Every rank of the sp group returns the same tensor, bit for bit.
    """
    check_layout(mesh, layout)
    layout._check_part(part)
    size, chunk = x_local.size(dim), layout.chunk_lengths[part]
    if size != chunk:
        if size != layout.local_len:
            raise ValueError(
                f"x_local has {size} tokens along dim {dim}; expected part {part}'s chunk ({chunk}) "
                f"or the whole local sequence ({layout.local_len})"
            )
        x_local = x_local.narrow(dim, layout.part_offset(part), chunk)
    if mesh.sp_group is None:
        return layout.unshard([x_local], part, dim)
    x_local = x_local.contiguous()
    chunks = [torch.empty_like(x_local) for _ in range(mesh.sp)]
    dist.all_gather(chunks, x_local, group=mesh.sp_group)  # group rank == sp_index (ascending ranks)
    return layout.unshard(chunks, part, dim)
