"""`strata setup`: measure the box (measure.py), choose the settings with the planner (choose.py), write a
config file that keeps what the user set (write.py), and check the predictions with a short run (check.py)."""
