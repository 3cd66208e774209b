# The README's two commands: `make demo` and `make test`. Each makes its own virtualenv.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-sim
TEST_STAMP = $(VENV)/.installed-test

.PHONY: demo test chaos bench venv system-deps clean real-sglang e2e catalogue soak-real

# The demo needs the package, its [sim] extra (the simulator) and [report] (matplotlib, for the
# night's report it writes at the end); the tests also need [test].
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[sim,report]'
	touch $(STAMP)

$(TEST_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,sim,report]'
	touch $(TEST_STAMP)

venv: $(TEST_STAMP)

system-deps:
	scripts/install-system-deps

# The night, then 10 s of serving at 0.88 for the report's timeline; it ends with the report's path.
demo: $(STAMP)
	$(VENV)/bin/sglang-supervisor demo --hold 10

# The whole suite, tier by tier with each tier's time: core + integration, chaos (CI size),
# then the real SGLang tier (its setup is cached; the first run installs SGLang).
test: $(TEST_STAMP) system-deps real-sglang
	$(PY) scripts/run-tiers

# The full reliability run (about an hour here): 20 trials per fault, the 1,000-cycle soak,
# then docs/reliability.md regenerated from the results.
chaos: $(TEST_STAMP) system-deps
	mkdir -p .chaos && rm -f .chaos/results.jsonl
	CHAOS_TRIALS=$${CHAOS_TRIALS:-20} SOAK_CYCLES=$${SOAK_CYCLES:-1000} CHAOS_RESULTS=.chaos/results.jsonl \
	  $(PY) -m pytest -q -ra -m chaos tests/chaos; \
	  status=$$?; $(PY) -m tests.chaos.report .chaos/results.jsonl -o docs/reliability.md; exit $$status

# A real SGLang server on the CPU (venv, libcuda stub, tiny model), cached under
# ${SGLANG_SUPERVISOR_CACHE:-~/.cache/sglang-supervisor}; the first run installs SGLang (several minutes).
real-sglang:
	scripts/setup-real-sglang

# The end-to-end tier against that real server.
e2e: $(TEST_STAMP) real-sglang
	@start=$$(date +%s); \
	  $(PY) -m pytest -q -ra tests/real -p no:cacheprovider; \
	  status=$$?; echo "e2e tier: $$(( $$(date +%s) - start )) s wall"; exit $$status

# A real night, compressed (tests/real/soak_real.py): two real SGLang servers owned by one daemon behind
# the real router, a real mosquitto, a client at concurrency 2, a fault every 45-90 s for SOAK_MINUTES
# (30; SOAK_SEED picks the night, printed). Holds the host's real-SGLang lock; the results go to
# .soak/results.json and a table; `python -m tests.real.soak_report .soak/results.json -o docs/reliability.md`
# puts them in docs/reliability.md.
soak-real: $(TEST_STAMP) system-deps real-sglang
	mkdir -p .soak
	flock /tmp/real-sglang.lock $(PY) -m tests.real.soak_real --minutes $${SOAK_MINUTES:-30} --out .soak/results.json

# The message catalogue and the module table (issue 23, docs/catalogue.md), regenerated from the pinned
# releases of scripts/catalogue/sources.toml; the wheels it lacks are downloaded into
# ${SGLANG_SUPERVISOR_CACHE:-~/.cache/sglang-supervisor}/catalogue (cold: ~3 min, then seconds); beside it
# the system's errno/signal/CUDA-code table and the engines' start-up functions (issue 35).
catalogue: $(TEST_STAMP)
	$(PY) scripts/catalogue/harvest.py
	$(PY) scripts/catalogue/meanings.py
	$(PY) scripts/catalogue/functions.py

bench: $(TEST_STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
