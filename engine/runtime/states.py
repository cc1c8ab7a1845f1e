"""Recurrent-state images: the GDN conv and recurrent state of one sequence at a token position.

Attention KV can be cut at any token; the Gated DeltaNet state cannot, so it is snapshotted where
continuations branch (every response boundary, the end of a shared prefix) and restored into a
batch row to continue from there without recomputing the past.

Two bounded tiers: `device_slots` images as device arrays, and up to `host_bytes_limit` bytes of
numpy copies. When a tier is full the image with the lowest (weight, last use) goes down one
tier: device -> host, host -> dropped. `on_evict(image)` is called before an image is dropped by
eviction, while it can still be read (`read(image)`); that is where a checkpointer saves it.
Pinned images (about to be restored into a running sequence) are never spilled or dropped.

`weight` is any float, higher kept longer; use `memory.retention_score`, whose values stay
comparable however long ago they were computed.
"""
from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from engine.model.config import ModelConfig
import engine.runtime.state_copy as sc


class StatePoolError(RuntimeError):
    """A state-pool call that its guard would have refused."""


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DROPPED = "dropped"


@dataclass(eq=False)
class StateImage:
    """A handle to one stored state. Only `StatePool` changes its fields."""
    id: int
    key: str            # content key, unique among live images (e.g. a hash of the token ids)
    num_tokens: int     # the token position the state is at
    weight: float
    tier: Tier = Tier.DEVICE
    slot: int | None = None
    pins: int = 0
    last_used: int = 0  # the pool's logical clock: ties in weight go least recently used first
    host: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False)

    @property
    def pinned(self) -> bool:
        return self.pins > 0


def state_image_bytes(cfg: ModelConfig, conv_itemsize: int) -> int:
    """Bytes of one image: conv state in the cache dtype plus fp32 recurrent state.
    qwen3.8-27b with a bf16 conv state: 48 x (48*128*128*4 + 10240*3*2) = 153,944,064 B."""
    layers = cfg.num_blocks * cfg.gdn_per_block
    conv = cfg.conv_dim * (cfg.linear_conv_kernel - 1) * conv_itemsize
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return layers * (conv + rec)


class StatePool:
    """Device slots [device_slots, nb, G, C, K-1] / [device_slots, nb, G, Hv, Dk, Dv] plus a host
    tier of at most `host_bytes_limit` bytes. `image_bytes` follows from the config and the conv
    dtype. Not thread-safe: the engine thread owns it."""

    def __init__(self, cfg: ModelConfig, device_slots: int, host_bytes_limit: int, *,
                 conv_dtype=jnp.float32, on_evict: Callable[[StateImage], None] | None = None):
        if not isinstance(device_slots, int) or device_slots <= 0:
            raise ValueError(f"device_slots must be a positive integer, got {device_slots!r}")
        if not isinstance(host_bytes_limit, int) or host_bytes_limit < 0:
            raise ValueError(f"host_bytes_limit must be a non-negative integer, "
                             f"got {host_bytes_limit!r}")
        nb, g = cfg.num_blocks, cfg.gdn_per_block
        self.conv_shape = (nb, g, cfg.conv_dim, cfg.linear_conv_kernel - 1)
        self.rec_shape = (nb, g, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim)
        self.conv_dtype = jnp.dtype(conv_dtype)
        self.image_bytes = state_image_bytes(cfg, self.conv_dtype.itemsize)
        self.device_slots = device_slots
        self.host_bytes_limit = host_bytes_limit
        self.host_capacity = host_bytes_limit // self.image_bytes  # whole images only
        self.on_evict = on_evict
        self._conv = jnp.zeros((device_slots,) + self.conv_shape, self.conv_dtype)
        self._rec = jnp.zeros((device_slots,) + self.rec_shape, jnp.float32)
        self._free_slots = list(range(device_slots))
        self._device: dict[int, StateImage] = {}  # by slot
        self._host: dict[int, StateImage] = {}    # by image id
        self._by_key: dict[str, StateImage] = {}
        self._ids = itertools.count()
        self._clock = 0
        self._in_hook = False
        self._counts = dict.fromkeys(("stores", "restores", "spills", "fetches", "evictions",
                                      "drops"), 0)

    # ---- queries ---------------------------------------------------------------------------
    def lookup(self, key: str) -> StateImage | None:
        return self._by_key.get(key)

    def images(self, tier: Tier | None = None) -> list[StateImage]:
        return [im for im in self._by_key.values() if tier is None or im.tier is tier]

    @property
    def device_bytes(self) -> int:
        return len(self._device) * self.image_bytes

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.image_bytes

    def stats(self) -> dict[str, int]:
        return {
            "image_bytes": self.image_bytes,
            "device_slots": self.device_slots,
            "device_images": len(self._device),
            "device_bytes": self.device_bytes,
            "device_reserved_bytes": self.device_slots * self.image_bytes,
            "host_images": len(self._host),
            "host_bytes": self.host_bytes,
            "host_bytes_limit": self.host_bytes_limit,
            "pinned_images": sum(1 for im in self._by_key.values() if im.pinned),
            **self._counts,
        }

    def read(self, image: StateImage) -> tuple[np.ndarray, np.ndarray]:
        """Host copies (conv, rec) of a live image in either tier; allowed inside `on_evict`."""
        self._check_live(image)
        if image.tier is Tier.HOST:
            return image.host[0].copy(), image.host[1].copy()
        conv, rec = sc.read_slot(self._conv, self._rec, np.int32(image.slot))
        return np.array(jax.device_get(conv)), np.array(jax.device_get(rec))

    # ---- store / restore -------------------------------------------------------------------
    def can_store(self) -> bool:
        """A device slot is free, or an unpinned device image can make room."""
        return bool(self._free_slots) or self._victim(self._device.values()) is not None

    def store(self, cache_conv: jax.Array, cache_rec: jax.Array, batch_row: int, *,
              key: str, num_tokens: int, weight: float) -> StateImage:
        """Snapshot batch row `batch_row` of the live cache (conv [nb, G, B, C, K-1], rec
        [nb, G, B, Hv, Dk, Dv]) into a device slot, evicting the lowest-ranked image if full."""
        self._check_mutable()
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if key in self._by_key:
            raise StatePoolError(f"an image with key {key!r} is already stored")
        nb, g, c, k1 = self.conv_shape
        batch = cache_conv.shape[2] if cache_conv.ndim == 5 else -1
        if (cache_conv.shape != (nb, g, batch, c, k1)
                or cache_rec.shape != self.rec_shape[:2] + (batch,) + self.rec_shape[2:]):
            raise ValueError(f"cache shapes {cache_conv.shape}, {cache_rec.shape} do not fit "
                             f"images of {self.conv_shape}, {self.rec_shape}")
        if cache_conv.dtype != self.conv_dtype or cache_rec.dtype != jnp.float32:
            raise ValueError(f"cache dtypes {cache_conv.dtype}, {cache_rec.dtype}: pool holds "
                             f"{self.conv_dtype} conv and float32 rec")
        if not 0 <= batch_row < batch:
            raise ValueError(f"batch_row {batch_row} outside [0, {batch})")
        if not self.can_store():
            raise StatePoolError("every device slot holds a pinned image")
        slot = self._take_slot()
        self._conv, self._rec = sc.snapshot_to_slot(self._conv, self._rec, cache_conv, cache_rec,
                                                    np.int32(batch_row), np.int32(slot))
        return self._register(key, num_tokens, weight, slot)

    def load(self, conv: np.ndarray, rec: np.ndarray, *, key: str, num_tokens: int,
             weight: float) -> StateImage:
        """Store an image given as host arrays (read from a checkpoint) into a device slot,
        evicting like `store`. conv [nb, G, C, K-1] conv dtype, rec [nb, G, Hv, Dk, Dv] fp32."""
        self._check_mutable()
        if key in self._by_key:
            raise StatePoolError(f"an image with key {key!r} is already stored")
        if (conv.shape != self.conv_shape or rec.shape != self.rec_shape
                or conv.dtype != self.conv_dtype or rec.dtype != np.float32):
            raise ValueError(f"image {conv.shape} {conv.dtype}, {rec.shape} {rec.dtype} does "
                             f"not fit {self.conv_shape} {self.conv_dtype}, {self.rec_shape}")
        if not self.can_store():
            raise StatePoolError("every device slot holds a pinned image")
        slot = self._take_slot()
        # device_put, not jnp.asarray (a staging computation compiled a shape: a first
        # restore's cost); conv and rec are not written after this
        self._conv, self._rec = sc.write_slot(self._conv, self._rec, jax.device_put(conv),
                                              jax.device_put(rec), np.int32(slot))
        return self._register(key, num_tokens, weight, slot)

    def _register(self, key: str, num_tokens: int, weight: float, slot: int) -> StateImage:
        """Book a freshly written device slot as the image stored under `key`."""
        image = StateImage(id=next(self._ids), key=key, num_tokens=num_tokens,
                           weight=float(weight), slot=slot)
        self._device[slot] = image
        self._by_key[key] = image
        self._touch(image)
        self._counts["stores"] += 1
        return image

    def restore(self, image: StateImage) -> tuple[jax.Array, jax.Array]:
        """The device image's (conv row [nb, G, C, K-1], rec row [nb, G, Hv, Dk, Dv]); write
        them into a batch row with `state_copy.write_row`. A host image must be fetched first."""
        self._check_tier(image, Tier.DEVICE)
        self._touch(image)
        self._counts["restores"] += 1
        return sc.read_slot(self._conv, self._rec, np.int32(image.slot))

    def restore_into(self, cache_conv: jax.Array, cache_rec: jax.Array, batch_row: int,
                     image: StateImage) -> tuple[jax.Array, jax.Array]:
        """`restore` fused with the write into the cache (donated); returns the new arrays."""
        self._check_tier(image, Tier.DEVICE)
        if not 0 <= batch_row < cache_conv.shape[2]:
            raise ValueError(f"batch_row {batch_row} outside [0, {cache_conv.shape[2]})")
        self._touch(image)
        self._counts["restores"] += 1
        return sc.restore_to_row(self._conv, self._rec, cache_conv, cache_rec,
                                 np.int32(image.slot), np.int32(batch_row))

    def warm(self, cache_conv: jax.Array, cache_rec: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Run each copy between the cache and the slots once (store, restore into a row, the
        checkpoint's write and read), through slot 0 and batch row 0, so that a first request
        compiles none of them. Books nothing (no image, no count). Only while no image is
        stored: it overwrites slot 0 and row 0. Returns the cache arrays (donated)."""
        self._check_mutable()
        if self._by_key or not self.device_slots:
            return cache_conv, cache_rec
        zero = np.int32(0)
        self._conv, self._rec = sc.snapshot_to_slot(self._conv, self._rec, cache_conv,
                                                    cache_rec, zero, zero)
        cache_conv, cache_rec = sc.restore_to_row(self._conv, self._rec, cache_conv, cache_rec,
                                                  zero, zero)
        jax.block_until_ready(sc.read_slot(self._conv, self._rec, zero))  # a spill's read
        # a checkpoint's image, as `load` puts it
        conv = jax.device_put(np.zeros(self.conv_shape, self.conv_dtype))
        rec = jax.device_put(np.zeros(self.rec_shape, np.float32))
        self._conv, self._rec = sc.write_slot(self._conv, self._rec, conv, rec, zero)
        return cache_conv, cache_rec

    # ---- tier moves ------------------------------------------------------------------------
    def can_spill(self, image: StateImage) -> bool:
        """On the device, unpinned, and the host has room or holds a lower-ranked image."""
        return (image.tier is Tier.DEVICE and not image.pinned
                and self._host_room_for(self._rank(image)) is not False)

    def spill(self, image: StateImage) -> None:
        """Move a device image to the host tier (its slot becomes free)."""
        self._check_mutable()
        if not self.can_spill(image):
            raise StatePoolError(f"cannot spill image {image.key!r} ({image.tier.value}, "
                                 f"pins={image.pins}, host {len(self._host)}/{self.host_capacity})")
        self._make_host_room(self._rank(image))
        arrays = self.read(image)
        self._free_slot(image)
        self._put_host(image, arrays)

    def can_fetch(self, image: StateImage) -> bool:
        return image.tier is Tier.HOST and self.can_store()

    def fetch(self, image: StateImage) -> None:
        """Move a host image back to a device slot, spilling the lowest-ranked device image."""
        self._check_mutable()
        if not self.can_fetch(image):
            raise StatePoolError(f"cannot fetch image {image.key!r} ({image.tier.value}, "
                                 f"{len(self._free_slots)} free slots)")
        # Take it off the host first: a spilled victim then always has room.
        conv, rec = image.host
        del self._host[image.id]
        image.host = None
        slot = self._take_slot()
        self._conv, self._rec = sc.write_slot(self._conv, self._rec, jnp.asarray(conv),
                                              jnp.asarray(rec), np.int32(slot))
        image.tier, image.slot = Tier.DEVICE, slot
        self._device[slot] = image
        self._touch(image)
        self._counts["fetches"] += 1

    def drop(self, image: StateImage) -> None:
        """Forget an image by the owner's decision (e.g. its response was deleted). Not an
        eviction: `on_evict` is not called."""
        self._check_mutable()
        self._check_live(image)
        if image.pinned:
            raise StatePoolError(f"image {image.key!r} is pinned")
        self._forget(image)
        self._counts["drops"] += 1

    # ---- retention -------------------------------------------------------------------------
    def pin(self, image: StateImage) -> None:
        self._check_live(image)
        image.pins += 1

    def unpin(self, image: StateImage) -> None:
        self._check_live(image)
        if image.pins == 0:
            raise StatePoolError(f"image {image.key!r} is not pinned")
        image.pins -= 1

    def set_weight(self, image: StateImage, weight: float) -> None:
        self._check_live(image)
        image.weight = float(weight)

    def touch(self, image: StateImage) -> None:
        self._check_live(image)
        self._touch(image)

    # ---- eviction internals ----------------------------------------------------------------
    @staticmethod
    def _rank(image: StateImage) -> tuple[float, int]:
        return image.weight, image.last_used

    def _victim(self, images) -> StateImage | None:
        return min((im for im in images if not im.pinned), key=self._rank, default=None)

    def _host_room_for(self, rank) -> StateImage | bool | None:
        """True: the host has a free place. An image: dropping it makes one (its rank is below
        `rank`). False: neither."""
        if len(self._host) < self.host_capacity:
            return True
        victim = self._victim(self._host.values())
        return victim if victim is not None and self._rank(victim) < rank else False

    def _make_host_room(self, rank) -> bool:
        room = self._host_room_for(rank)
        if isinstance(room, StateImage):
            self._evict_drop(room)
            return True
        return room

    def _take_slot(self) -> int:
        """A free slot, spilling (or, if the host has no place for it, dropping) a victim."""
        if not self._free_slots:
            victim = self._victim(self._device.values())
            if self._make_host_room(self._rank(victim)):
                arrays = self.read(victim)
                self._free_slot(victim)
                self._put_host(victim, arrays)
            else:
                self._evict_drop(victim)
        return heapq.heappop(self._free_slots)

    def _evict_drop(self, image: StateImage) -> None:
        # The hook runs while the image is intact; if it raises, nothing has changed.
        if self.on_evict is not None:
            self._in_hook = True
            try:
                self.on_evict(image)
            finally:
                self._in_hook = False
        self._forget(image)
        self._counts["evictions"] += 1

    def _put_host(self, image: StateImage, arrays: tuple[np.ndarray, np.ndarray]) -> None:
        image.tier, image.slot, image.host = Tier.HOST, None, arrays
        self._host[image.id] = image
        self._counts["spills"] += 1

    def _free_slot(self, image: StateImage) -> None:
        del self._device[image.slot]
        heapq.heappush(self._free_slots, image.slot)
        image.slot = None

    def _forget(self, image: StateImage) -> None:
        if image.tier is Tier.DEVICE:
            self._free_slot(image)
        else:
            del self._host[image.id]
            image.host = None
        del self._by_key[image.key]
        image.tier = Tier.DROPPED

    def _touch(self, image: StateImage) -> None:
        self._clock += 1
        image.last_used = self._clock

    def _check_live(self, image: StateImage) -> None:
        if image.tier is Tier.DROPPED or self._by_key.get(image.key) is not image:
            raise StatePoolError(f"image {image.key!r} is not in this pool")

    def _check_tier(self, image: StateImage, tier: Tier) -> None:
        self._check_live(image)
        if image.tier is not tier:
            raise StatePoolError(f"image {image.key!r} is on {image.tier.value}, "
                                 f"needs {tier.value}")

    def _check_mutable(self) -> None:
        if self._in_hook:
            raise StatePoolError("on_evict must not change the pool")
