"""A step projected to a pod: the strategies and the meshes compiled for them (``mesh``), a compiled
step costed on a system (``cost``), the rows, their table and plot (``rows``), the projection itself
(``project``), and its check against measured steps (``validate``). The top of the layers: it
compiles the workloads with podscale's strategies, and ``validate`` runs ``bench``'s."""
