# The two set-up commands in the README: `make run` and `make test`.
# Both create .venv themselves (scripts/bootstrap.sh finds a Python >= 3.12).
PY := .venv/bin/python
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: venv run test soak clean

venv:
	@bash scripts/bootstrap.sh

run: venv
	$(PY) -m experiments

# The suite starts more than fifty Python processes (two workers, servers, experiment and
# multi-process children). Where PYTHONDONTWRITEBYTECODE is set, as on the development
# machines, each one compiled the project's sources again and each worker rewrote every test
# module's asserts again; here the first writes the .pyc files (in __pycache__, ignored by
# git) and the rest read them.
test: venv
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 tests

# Not part of `make test`: a long randomised search of the allocator and engine state
# machines, then a served checkpoint under concurrent load, disconnects, cancels, page faults
# and corrupted transfers for four minutes (scripts/serve_soak.py).
soak: venv
	HYPOTHESIS_PROFILE=soak $(PY) -m pytest -q tests/test_state_machine.py
	$(PY) scripts/serve_soak.py --duration 240

clean:
	rm -rf .venv results .pytest_cache
