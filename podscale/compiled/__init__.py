"""The ground floor: compiled modules read (``hlo``, with ``hlo_cost``, ``hlo_library``,
``hlo_groups`` and ``hlo_loops``), the systems and their networks (``systems``, ``network``,
``tpu``), and the cost of a gradient sum over mesh axes (``gradsum_cost``). Every other layer may
import these; they import nothing of podscale's but ``_jax``."""
