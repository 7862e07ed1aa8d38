"""The benchmark workloads: one package per benchmark, sharing workloads.common."""

import time

STARTED = time.time()  # when this worker process started: a restarted attempt's start-up begins here
