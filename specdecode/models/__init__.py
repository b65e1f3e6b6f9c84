"""Model runtimes: the native Llama-family runtime (llama.py, the CPU kernels through
cpu_runtime.py) and the transformers adapter (hf.py)."""


def device_label(device) -> str:
    """How a runtime names where it runs, in ``describe`` (which keys the cost profile, so a
    GPU's costs never stand in for the CPU's on the same machine): '' on the CPU (the key
    CPU profiles have always had), ' on <GPU name>' on CUDA, else ' on <device type>'."""
    import torch

    if device.type == "cuda":
        return f" on {torch.cuda.get_device_name(device)}"
    return "" if device.type == "cpu" else f" on {device.type}"
