"""M-RoPE position ids of one document, computed like HF's Qwen3-VL ``get_rope_index``.

Qwen-VL text decoders rotate with three position rows ``(t, h, w)``. For one document:

- a run of text tokens (``vision_start`` / ``vision_end`` are text) gets ``cur + arange(n)`` on all
  three rows, then ``cur += n``;
- a run of image tokens with patch grid ``(t, h, w)`` (merged to ``h/m x w/m`` tokens per frame)
  gets ``t: cur + arange(t)``, ``h: cur + arange(h/m)``, ``w: cur + arange(w/m)``, meshed
  t-major, then ``cur += max(h, w) / m``: the next text position is one past the image's largest.

Each image-token run takes the next grid of ``image_grid_thw`` in order; the vision markers around
every image keep two images from forming one run. In a packed row every document starts again at
position 0 (the loader calls this once per document).
"""

from __future__ import annotations

import numpy as np

__all__ = ["mrope_position_ids"]


def mrope_position_ids(
    input_ids: np.ndarray, image_grid_thw: np.ndarray, *, image_token_id: int, merge_size: int
) -> np.ndarray:
    """int64 ``[3, L]`` M-RoPE positions of a document ``input_ids`` ``[L]`` with images ``[n, 3]``.

    Raises ``ValueError`` when the image-token runs do not match the grids (count or size).
    """
    ids = np.asarray(input_ids).reshape(-1)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    is_image = ids == image_token_id
    # Boundaries of the runs of equal type: starts of every run, then the end.
    change = np.flatnonzero(is_image[1:] != is_image[:-1]) + 1
    starts = np.concatenate([[0], change]) if len(ids) else np.zeros(0, np.int64)
    ends = np.concatenate([change, [len(ids)]]) if len(ids) else np.zeros(0, np.int64)
    out = np.empty((3, len(ids)), dtype=np.int64)
    cur = 0
    image = 0
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        if not is_image[lo]:
            out[:, lo:hi] = cur + np.arange(hi - lo, dtype=np.int64)
            cur += hi - lo
            continue
        if image >= len(grids):
            raise ValueError(f"input_ids hold more image-token runs than the {len(grids)} image grid(s)")
        t, h, w = (int(v) for v in grids[image])
        gh, gw = h // merge_size, w // merge_size
        if h % merge_size or w % merge_size or t * gh * gw != hi - lo:
            raise ValueError(
                f"image {image}: a run of {hi - lo} image tokens does not match grid (t={t}, h={h}, w={w}) "
                f"merged by {merge_size} ({t * gh * gw} tokens)"
            )
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[0, lo:hi] = cur + tt.reshape(-1)
        out[1, lo:hi] = cur + hh.reshape(-1)
        out[2, lo:hi] = cur + ww.reshape(-1)
        cur += max(h, w) // merge_size
        image += 1
    if image != len(grids):
        raise ValueError(f"input_ids hold {image} image-token run(s) but {len(grids)} image grid(s) were given")
    return out
