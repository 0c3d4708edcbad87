#!/usr/bin/env python3
"""Test oracle for DeepSpeed's `elasticity` config section.

Runs the *real*, unmodified DeepSpeed code (deepspeed.elasticity.compute_elastic_config, and where a
full `import deepspeed` works also deepspeed.runtime.config.DeepSpeedConfig) over a fixed list of cases
and writes the outcomes as JSON.

Made with DeepSpeed 0.19.7 (the last release with elasticity; 0.19.8 removed it) in a scratch venv:
    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install --no-deps deepspeed==0.19.7 &&
    /tmp/dsvenv/bin/pip install numpy packaging          # then --shim; or add torch and DeepSpeed's
                                                          # requirements for the DeepSpeedConfig cases
Usage (from the repository root):
    /tmp/dsvenv/bin/python tests/data/deepspeed_elasticity/make_oracle.py [--out tests/data/deepspeed_elasticity/oracle.json] [--shim]
                                                       [--explore]

Two ways of loading DeepSpeed:
  * full:  `import deepspeed` (needs torch and DeepSpeed's other requirements in the venv).
  * shim:  only numpy + packaging + the installed deepspeed package files (pip install --no-deps
           deepspeed==0.19.7). The package's top-level __init__ (which imports torch) is not executed;
           deepspeed.utils (only `logger` is used), deepspeed.utils.torch (only required_torch_version is
           used, to decide whether to import the torch elastic agent) and deepspeed.git_version_info
           (only `version`) are replaced by tiny stand-ins. deepspeed/elasticity/*.py themselves are the
           real files, executed as shipped.
The default is full if it imports, else shim; --shim forces the shim.

Each case is
  {"via": "compute_elastic_config", "config": {<elasticity section>}, "world_size": N,
   "result": {"final_batch_size", "valid_gpus", "micro_batch_size", "gradient_accumulation_steps"}}
or the same with "error": "<ExceptionClass>: <message>" instead of "result".
gradient_accumulation_steps is computed the way DeepSpeedConfig does it:
final_batch_size // (micro_batch_size * world_size).
world_size 0 means "not given" (compute_elastic_config's default); v0.1 then returns no micro batch
(micro_batch_size and gradient_accumulation_steps are null), v0.2 reads the WORLD_SIZE env var, which
this script removes from the environment unless a case sets "env".

Cases with "via": "DeepSpeedConfig" (full mode only) build deepspeed.runtime.config.DeepSpeedConfig from
{"elasticity": config, **top_level} with deepspeed.comm's get_rank/get_world_size patched so that the
data-parallel world size is world_size, and report the resulting train_batch_size,
train_micro_batch_size_per_gpu and gradient_accumulation_steps.
"""
import argparse
import copy
import importlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import types


def _purge_deepspeed_modules():
    for name in list(sys.modules):
        if name == "deepspeed" or name.startswith("deepspeed."):
            del sys.modules[name]


def load_deepspeed(force_shim=False):
    """Returns (compute_elastic_config, deepspeed_version, mode, DeepSpeedConfig-or-None, comm-or-None)."""
    if not force_shim:
        try:
            import deepspeed  # noqa: F401
            from deepspeed.elasticity import compute_elastic_config
            from deepspeed.git_version_info import version
            from deepspeed.runtime.config import DeepSpeedConfig
            import deepspeed.runtime.config as rc
            return compute_elastic_config, version, "full", DeepSpeedConfig, rc
        except Exception as e:  # torch or another requirement missing
            print(f"[oracle] full `import deepspeed` failed ({type(e).__name__}: {e}); using the shim",
                  file=sys.stderr)
            _purge_deepspeed_modules()

    spec = importlib.util.find_spec("deepspeed")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("deepspeed is not installed in this interpreter (pip install --no-deps deepspeed==0.19.7)")
    pkg_dir = list(spec.submodule_search_locations)[0]

    def make_pkg(name, path=None):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
        if path is not None:
            m.__path__ = [path]
            m.__spec__.submodule_search_locations = [path]
        sys.modules[name] = m
        return m

    make_pkg("deepspeed", pkg_dir)
    utils = make_pkg("deepspeed.utils", os.path.join(pkg_dir, "utils"))
    utils.logger = logging.getLogger("DeepSpeed")
    utils_torch = make_pkg("deepspeed.utils.torch")
    utils_torch.required_torch_version = lambda min_version=None, max_version=None: False
    utils.torch = utils_torch
    installed = importlib.import_module("deepspeed.git_version_info_installed")  # plain assignments only
    gvi = make_pkg("deepspeed.git_version_info")
    gvi.version = installed.version

    from deepspeed.elasticity import compute_elastic_config  # the real package and files
    return compute_elastic_config, installed.version, "shim", None, None


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, float) and not x.is_integer():
        return x
    try:
        return int(x)  # numpy ints, integral floats
    except Exception:
        return repr(x)


def run_compute(compute, ds_version, case):
    cfg = copy.deepcopy(case["config"])
    ws = case["world_size"]
    saved = os.environ.pop("WORLD_SIZE", None)
    for k, v in case.get("env", {}).items():
        os.environ[k] = v
    try:
        out = compute(ds_config={"elasticity": cfg}, target_deepspeed_version=case.get("target_version", ds_version),
                      world_size=ws)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        for k in case.get("env", {}):
            os.environ.pop(k, None)
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved
    if len(out) == 3:
        final, valid, mbs = out
        gas = final // (mbs * ws) if ws else None
    else:
        (final, valid), mbs, gas = out, None, None
    return {"result": {"final_batch_size": _jsonable(final), "valid_gpus": _jsonable(valid),
                       "micro_batch_size": _jsonable(mbs), "gradient_accumulation_steps": _jsonable(gas)}}


def run_runtime(DeepSpeedConfig, rc, case):
    ws = case["world_size"]
    ds_config = {"elasticity": copy.deepcopy(case["config"])}
    ds_config.update(copy.deepcopy(case.get("top_level", {})))
    dist = rc.dist
    saved = (dist.get_rank, dist.get_world_size)
    dist.get_rank = lambda *a, **k: 0
    dist.get_world_size = lambda *a, **k: ws
    os.environ.pop("DEEPSPEED_ELASTICITY_CONFIG", None)
    try:
        c = DeepSpeedConfig(ds_config)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        dist.get_rank, dist.get_world_size = saved
    return {"result": {"train_batch_size": _jsonable(c.train_batch_size),
                       "train_micro_batch_size_per_gpu": _jsonable(c.train_micro_batch_size_per_gpu),
                       "gradient_accumulation_steps": _jsonable(c.gradient_accumulation_steps),
                       "world_size_seen": _jsonable(c.world_size)}}


def E(**kw):
    """An enabled elasticity section (keys given as keyword arguments)."""
    d = {"enabled": True}
    d.update(kw)
    return d


V1 = 0.1
V2 = 0.2

# (config, [world sizes]) for compute_elastic_config
COMPUTE_CASES = [
    # ---- v0.1, the defaults-like config from the docs
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1), [1, 7, 16, 64, 11, 0]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1, prefer_larger_batch=False), [7, 16, 11]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=8, max_gpus=64, min_time=20,
       version=V1), [8, 24, 4]),
    # ---- DeepSpeed's own unit test config (test_basic_10k): 9792 and 23 valid GPU counts
    (E(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, min_time=20,
       version=V1), [64, 96, 33]),
    (E(max_train_batch_size=10000, micro_batch_sizes=[8], version=V1), [1, 5, 10]),
    (E(max_train_batch_size=10000, micro_batch_sizes=[1, 2, 3, 5], version=V1), [1, 2, 7, 13]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[1, 2, 3, 5], min_gpus=4, max_gpus=64, version=V1,
       prefer_larger_batch=False), [4, 6, 64]),
    (E(max_train_batch_size=24, micro_batch_sizes=[2, 4, 6], version=V1), [1, 2, 3, 4, 6, 5]),
    (E(max_train_batch_size=24, micro_batch_sizes=[2, 4, 6], version=V1, prefer_larger_batch=False), [2, 4]),
    (E(max_train_batch_size=7, micro_batch_sizes=[1, 2, 3, 5], version=V1), [1, 2, 3, 4]),
    # LCM above the cap (the #8237 fix in 0.19.6+): older releases returned 120 / 42 / 24 here
    (E(max_train_batch_size=100, micro_batch_sizes=[8, 10, 12], min_gpus=1, max_gpus=1500, version=V1), [1, 5]),
    (E(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], version=V1), [4, 7]),
    (E(max_train_batch_size=16, micro_batch_sizes=[8, 12], version=V1), [1, 2]),
    # no candidate has any valid GPU count in [11, 11]
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=11, max_gpus=11, version=V1), [11]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=11, max_gpus=11, version=V1,
       prefer_larger_batch=False), [11]),
    # version given as a string, and version omitted (defaults to 0.2)
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version="0.1"), [16]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6]), [16, 11]),
    # duplicates / unsorted micro batches
    (E(max_train_batch_size=1000, micro_batch_sizes=[6, 2, 6, 4], version=V1), [10]),
    # ---- v0.2
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2), [16, 11, 7]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, prefer_larger_batch=False), [16, 11]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, model_parallel_size=2,
       num_gpus_per_node=4), [2, 4, 8, 16, 32, 6, 12]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, model_parallel_size=2,
       num_gpus_per_node=4, prefer_larger_batch=False), [8, 16]),
    (E(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=V2,
       num_gpus_per_node=4), [64, 128, 36, 30]),
    (E(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500, version=V2,
       model_parallel_size=2, num_gpus_per_node=4), [32, 64, 128]),
    (E(max_train_batch_size=24, micro_batch_sizes=[8], version=V2), [1, 3, 5]),
    # fallback with prefer_larger_batch false takes the minimum, which is 0 as soon as one micro batch * W > max
    (E(max_train_batch_size=24, micro_batch_sizes=[2, 4, 6], version=V2, prefer_larger_batch=False), [5, 12]),
    (E(max_train_batch_size=7, micro_batch_sizes=[1, 2, 3, 5], version=V2), [1, 7]),
    (E(max_train_batch_size=7, micro_batch_sizes=[1, 2, 3, 5], version=V2, model_parallel_size=2,
       num_gpus_per_node=4), [2]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, num_gpus_per_node=8,
       max_gpus=4), [8, 16]),
    # v0.2 fallback uses floating point: (61 / 7) * 7 == 60.99999999999999, so the valid list becomes [60] and
    # world size 61 is rejected, while (29 / 7) * 7 == 29.000000000000004 truncates to 29 and is accepted
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, num_gpus_per_node=7), [28, 29, 61]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, model_parallel_size=3,
       num_gpus_per_node=4), [4]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[1, 2, 3, 5], version=V2, model_parallel_size=2,
       num_gpus_per_node=4, min_gpus=8, max_gpus=64), [8, 16, 24]),
    # ---- config / version errors
    (E(micro_batch_sizes=[2, 4, 6], version=V1), [1]),
    (E(max_train_batch_size=2000, version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=4, version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4.0], version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[0, 2], version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[], version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=0, version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_gpus=8, max_gpus=4, version=V1), [4]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], min_time=-1, version=V1), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], model_parallel_size=0, version=V2), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], num_gpus_per_node=0, version=V2), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], model_parallel_size=2, version=V1), [2]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=0.3), [1]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=0.15), [1]),
    (E(max_train_batch_size=7, micro_batch_sizes=[8], version=V1), [1]),
    ({"enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}, [1]),
]

EXTRA_COMPUTE_CASES = [
    # v0.2 with world_size not given: WORLD_SIZE from the environment, or an error
    {"config": E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2), "world_size": 0},
    {"config": E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2), "world_size": 0,
     "env": {"WORLD_SIZE": "16"}},
    # DeepSpeed's own test_model_parallel_v2_valid: WORLD_SIZE (total GPUs) from the environment, no world-size check
    {"config": E(max_train_batch_size=10000, micro_batch_sizes=[8, 12, 16, 17], min_gpus=32, max_gpus=1500,
                 min_time=20, version=V2, model_parallel_size=4, num_gpus_per_node=8), "world_size": 0,
     "env": {"WORLD_SIZE": "16"}},
    # target DeepSpeed version below the minimum 0.3.8
    {"config": E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1), "world_size": 16,
     "target_version": "0.3.7"},
]

# (config, top-level keys, world sizes) for DeepSpeedConfig (full mode only)
RUNTIME_CASES = [
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1), {}, [8, 7, 16]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1), {"train_batch_size": 64}, [8]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1),
     {"gradient_accumulation_steps": 3}, [8]),
    # the batch-key check comes after compute_elastic_config, so an invalid world size wins
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1), {"train_batch_size": 64}, [16]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V1, ignore_non_elastic_batch_info=True),
     {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 3}, [8]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2), {}, [16]),
    (E(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=V2, model_parallel_size=2,
       num_gpus_per_node=4), {}, [8, 16]),
    (E(max_train_batch_size=24, micro_batch_sizes=[8], version=V2), {}, [3, 5]),
]


def build_cases():
    cases = []
    for cfg, sizes in COMPUTE_CASES:
        for ws in sizes:
            cases.append({"via": "compute_elastic_config", "config": cfg, "world_size": ws})
    for c in EXTRA_COMPUTE_CASES:
        cases.append(dict({"via": "compute_elastic_config"}, **c))
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/deepspeed_elasticity/oracle.json")
    ap.add_argument("--shim", action="store_true", help="do not try a full `import deepspeed`")
    ap.add_argument("--explore", action="store_true", help="print valid GPU lists per config, write nothing")
    args = ap.parse_args()

    logging.disable(logging.CRITICAL)  # DeepSpeed logs candidates etc. at INFO; keep stdout clean
    compute, ds_version, mode, DeepSpeedConfig, rc = load_deepspeed(args.shim)
    print(f"[oracle] deepspeed {ds_version}, mode={mode}", file=sys.stderr)

    if args.explore:
        for cfg, sizes in COMPUTE_CASES:
            r = run_compute(compute, ds_version, {"config": cfg, "world_size": 0, "env": {"WORLD_SIZE": "1"}})
            print(json.dumps(cfg), "->", json.dumps(r))
        return

    cases = build_cases()
    for c in cases:
        c.update(run_compute(compute, ds_version, c))
    if DeepSpeedConfig is not None:
        for cfg, top, sizes in RUNTIME_CASES:
            for ws in sizes:
                c = {"via": "DeepSpeedConfig", "config": cfg, "top_level": top, "world_size": ws}
                c.update(run_runtime(DeepSpeedConfig, rc, c))
                cases.append(c)
    doc = cases
    with open(args.out, "w") as f:  # one case per line
        f.write("[\n" + ",\n".join(json.dumps(c) for c in doc) + "\n]\n")
    n_err = sum(1 for c in cases if "error" in c)
    print(f"[oracle] wrote {len(cases)} cases ({n_err} errors) to {args.out} "
          f"(deepspeed {ds_version}, mode={mode})", file=sys.stderr)


if __name__ == "__main__":
    main()
