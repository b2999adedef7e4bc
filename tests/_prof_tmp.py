import sys, time, cProfile, pstats
sys.path.insert(0, ".")
import conftest  # noqa
import test_contract as t
t0=time.time()
groups = t._groups(t.GRID); print("groups", time.time()-t0)
pr = cProfile.Profile(); pr.enable()
t0=time.time()
r = t._reference(groups[0], t.STEPS); print("ref", time.time()-t0)
t0=time.time()
t._run_strategy("8-sharded", groups[0], t.STEPS); print("par", time.time()-t0)
pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
