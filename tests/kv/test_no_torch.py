import subprocess
import sys

BLOCK_TORCH = """
import sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
        return None
sys.meta_path.insert(0, BlockTorch())
"""


def test_kv_package_imports_and_runs_without_torch():
    code = BLOCK_TORCH + """
import hybridkv.kv as kv
from hybridkv.kv.managers import MANAGER_BY_KIND
from hybridkv.models.layer_mix import kv_layout_from_config, load_hf_config
layout = kv_layout_from_config(load_hf_config("gpt-oss-20b"))
plan = kv.plan_kv_cache(layout.layer_specs, 1 << 30, max_model_len=4096,
                        max_num_batched_tokens=512)
manager = kv.KVCacheManager(plan.config, max_model_len=4096)
req = kv.KVRequest("a", list(range(100)), hash_block_size=16)
assert manager.allocate_slots(req, 100) is not None
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("the blocker did not block torch")
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
