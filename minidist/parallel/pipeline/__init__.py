"""Pipeline parallelism: schedules as data, the runtime that executes them, and the simulator that
times and checks them."""
