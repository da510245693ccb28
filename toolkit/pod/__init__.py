"""Pods: joining processes into one job (`distributed`), a pod simulated on one machine
(`local`), compile targets (`target`), ahead-of-time compiles and their report (`aot`,
`report`, `estimate`, `collectives`), and the layout planner with its plan files (`planner`,
`plan`). The accelerator table itself is `toolkit.accelerators` (the launchers use it too)."""
