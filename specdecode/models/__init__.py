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


def synchronize(device) -> None:
    """Wait until ``device`` has run what was queued on it, so that a timer read next
    charges a pass its own work: on a GPU a forward pass returns once its kernels are
    queued. Nothing on the CPU, where every call has finished when it returns."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
