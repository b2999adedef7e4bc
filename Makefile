PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# Train the small ResNet on scikit-learn's digits on 8 CPU replicas to 97% held-out accuracy.
demo: $(BIN)/.installed
	$(BIN)/podscale train --model resnet --data digits --optimizer adam --learning-rate 3e-3 \
	  --batch-size 128 --steps 600 --eval-every 25 --target 0.97 --replicas 8

# The tests also compile for TPU slices (libtpu's compile-only topologies): the tpu extra.
$(BIN)/.installed-tpu: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test,tpu]'
	touch $@

test: $(BIN)/.installed-tpu
	$(BIN)/ruff check podscale tests
	$(BIN)/ruff format --check podscale tests
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

clean:
	rm -rf $(VENV) build *.egg-info
