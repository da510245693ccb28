"""Planning, what is known about a job before it runs:

- `target`: compile targets (a TPU topology or simulated host devices);
- `aot`: the real step compiled ahead of time for a target, and its memory;
- `report`: the compile report's text (fits or not, memory, collectives, decode);
- `estimate`: the analytic estimate of a step's time, memory and communication;
- `planner`, `candidates`, `plan`: the layout planner, its search space and plan files;
- `hlo`: the compiled program's HLO text, read;
- `collectives`: the collectives a program runs and the bytes they move;
- `scheduling`: which of them the compiler made asynchronous;
- `traffic`: the bytes each instruction moves over each link;
- `cost/`: prices, time and dollars per target, and the ranking (`python -m toolkit.cost`).
"""
