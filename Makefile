.PHONY: test demo

# Extra pytest arguments: make test ARGS="-m 'not slow' -x"
ARGS ?=

test:
	bash scripts/test.sh $(ARGS)

demo:
	bash scripts/demo.sh
