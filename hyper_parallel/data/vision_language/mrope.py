"""M-RoPE position ids of one document, computed like HF's Qwen3-VL ``get_rope_index``.

Qwen-VL text decoders rotate with three position rows ``(t, h, w)``. For one document:

- a run of text tokens (``vision_start`` / ``vision_end`` are text) gets ``cur + arange(n)`` on all
  three rows, then ``cur += n``;
- a run of image tokens with patch grid ``(t, h, w)`` (merged to ``h/m x w/m`` tokens per frame)
  gets ``t: cur + arange(t)``, ``h: cur + arange(h/m)``, ``w: cur + arange(w/m)``, meshed
  t-major, then ``cur += max(h, w) / m``: the next text position is one past the image's largest.

Each image-token run takes the next grid of ``image_grid_thw`` in order; the vision markers around
every image keep two images from forming one run. A video ``(t, h, w)`` is ``t`` such runs of video
tokens (one per temporal patch, with its timestamp text between them), each placed like a
``(1, h, w)`` image. In a packed row every document starts again at
position 0 (the loader calls this once per document).
"""

from __future__ import annotations

import numpy as np

__all__ = ["mrope_position_ids"]


def mrope_position_ids(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray,
    *,
    image_token_id: int,
    merge_size: int,
    video_grid_thw: np.ndarray | None = None,
    video_token_id: int | None = None,
) -> np.ndarray:
    """int64 ``[3, L]`` M-RoPE positions of a document ``input_ids`` ``[L]`` with images ``[n, 3]`` and videos.

    A video ``(t, h, w)`` is ``t`` frame groups, each its own run of ``h*w/m^2`` video tokens (timestamp
    text and vision markers sit between them) positioned like an image ``(1, h, w)``, as HF splits
    ``video_grid_thw`` before ``get_rope_index``. Raises ``ValueError`` when the runs do not match the grids.
    """
    ids = np.asarray(input_ids).reshape(-1)
    grids = {1: np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)}
    kind = np.where(ids == image_token_id, 1, 0)
    if video_token_id is not None:
        videos = np.zeros((0, 3), np.int64) if video_grid_thw is None else np.asarray(video_grid_thw, np.int64)
        videos = videos.reshape(-1, 3)
        frames = np.repeat(videos, videos[:, 0], axis=0)
        frames[:, 0] = 1
        grids[2] = frames
        kind = np.where(ids == video_token_id, 2, kind)
    elif video_grid_thw is not None and len(np.asarray(video_grid_thw).reshape(-1, 3)):
        raise ValueError("video_grid_thw given without video_token_id")
    names = {1: "image", 2: "video frame group"}
    # Boundaries of the runs of equal type: starts of every run, then the end.
    change = np.flatnonzero(kind[1:] != kind[:-1]) + 1
    starts = np.concatenate([[0], change]) if len(ids) else np.zeros(0, np.int64)
    ends = np.concatenate([change, [len(ids)]]) if len(ids) else np.zeros(0, np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    cur = 0
    used = {1: 0, 2: 0}
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        k = int(kind[lo])
        if k == 0:
            out[:, lo:hi] = cur + np.arange(hi - lo, dtype=np.int64)
            cur += hi - lo
            continue
        n = used[k]
        if n >= len(grids[k]):
            raise ValueError(f"input_ids hold more {names[k]} token runs than the {len(grids[k])} {names[k]} grid(s)")
        t, h, w = (int(v) for v in grids[k][n])
        gh, gw = h // merge_size, w // merge_size
        if h % merge_size or w % merge_size or t * gh * gw != hi - lo:
            raise ValueError(
                f"{names[k]} {n}: a run of {hi - lo} tokens does not match grid (t={t}, h={h}, w={w}) "
                f"merged by {merge_size} ({t * gh * gw} tokens)"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, lo:hi] = cur + tt.reshape(-1)
        out[1, lo:hi] = cur + hh.reshape(-1)
        out[2, lo:hi] = cur + ww.reshape(-1)
        cur += max(h, w) // merge_size
        used[k] = n + 1
    for k, g in grids.items():
        if used[k] != len(g):
            raise ValueError(f"input_ids hold {used[k]} {names[k]} token run(s) but {len(g)} {names[k]} grid(s) were given")
    return out
