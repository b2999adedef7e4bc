"""The performance model: compiled modules read (``hlo``), systems and their networks costed
(``systems``, ``network``, ``tpu``), and a step projected to a pod (``project``, ``validate``)."""
