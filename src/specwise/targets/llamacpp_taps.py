"""Hidden states out of a llama.cpp decode: the graph evaluation callback (``cb_eval``).

Asked for a decode's taps, the callback names the graph tensors wanted (HF ``hidden_states[i]`` is
ggml's ``l_out-(i-1)``, the final normed state is ``result_norm``) and copies them out as the graph
reaches them; with no taps wanted it declines every tensor, so the graph runs unsplit.
"""

from __future__ import annotations

import ctypes

import numpy as np

from specwise.targets.llamacpp_backend import ggml_base, lc

#: byte offsets in ``struct ggml_tensor``: ``enum ggml_type type`` at 0, ``int64_t ne[4]`` at 16
_TYPE_OFFSET, _NE_OFFSET, _GGML_F32 = 0, 16, 0


class Taps:
    """The context's graph evaluation callback: copies the tensors one decode asks for.

    Attributes:
        wanted: ggml tensor name -> HF hidden-state index, for the decode under way (empty: none).
        got: HF index -> the ``[rows, H]`` float32 arrays copied, in graph order.
    """

    def __init__(self) -> None:
        self.wanted: dict[bytes, int] = {}
        self.got: dict[int, list[np.ndarray]] = {}
        self._base = None
        self.error: BaseException | None = None  # what the callback raised during the decode under way
        self.callback = lc.ggml_backend_sched_eval_callback(self._call)

    def ask(self, wanted: dict[bytes, int]) -> None:
        """Ask the next decodes for ``wanted`` (``{}``: none), dropping what was copied and any error."""
        if wanted and self._base is None:
            self._base = ggml_base()
        self.wanted = wanted
        self.got = {layer: [] for layer in wanted.values()}
        self.error = None

    def _call(self, tensor, ask, user_data) -> bool:
        if not self.wanted:
            return False  # nothing wanted: no tensor is kept, so the graph is not split
        # an exception cannot cross ggml's C frames (ctypes would print and drop it): it is kept for
        # the decode to raise, and returning False stops the graph's computation
        try:
            return self._copy(tensor, ask)
        except Exception as exc:  # noqa: BLE001 - re-raised by the decode that asked
            self.error = exc
            return False

    def _copy(self, tensor, ask) -> bool:
        layer = self.wanted.get(self._base.ggml_get_name(tensor))
        if layer is None:
            return False
        if ask:
            return True
        if ctypes.c_int.from_address(tensor + _TYPE_OFFSET).value != _GGML_F32:
            raise RuntimeError("a tapped hidden state is not float32")  # ggml's activations are; cannot happen
        ne = (ctypes.c_int64 * 4).from_address(tensor + _NE_OFFSET)
        out = np.empty((ne[1], ne[0]), dtype=np.float32)
        self._base.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, out.nbytes)
        self.got[layer].append(out)
        return True  # go on computing
