.PHONY: test demo soak

# Extra pytest arguments: make test ARGS="-m 'not slow' -x"
ARGS ?=

test:
	bash scripts/test.sh $(ARGS)

demo:
	bash scripts/demo.sh

# The long randomized soaks: the chaos cases' full schedule (>= 10 SIGKILLs, bigger streams, more
# rounds of every fault) and every other test marked slow. CI runs their short schedule in `make test`.
soak:
	INGEST_CHAOS_LONG=1 bash scripts/test.sh -m slow $(ARGS)
