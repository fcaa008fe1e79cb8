import torch

#: torch.__version__ of the torch this module was compiled against (it is used with that one only).
TORCH_BUILT_WITH: str

def step_structure(batch: object, block_size: object, device: torch.device, /) -> bool: ...
def bind(cls: type, /) -> None: ...
