"""What a job costs on each target:

- `layouts`: the layout priced per target (the planner's candidates by the analytic estimate);
- `prices`: the price table;
- `economics`: time, dollars, preemption and the Pareto front;
- `ranking`: the ranking `python -m toolkit.cost` prints, from all of the above;
- `report`: the ranking's table and plot.
"""
