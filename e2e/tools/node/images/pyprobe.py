"""NVML as NVIDIA's own Python bindings (nvidia-ml-py) see it in the container."""

import pynvml

pynvml.nvmlInit()
count = pynvml.nvmlDeviceGetCount()
print(f"pynvml_count={count}")
for i in range(count):
    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    if isinstance(uuid, bytes):
        uuid = uuid.decode()
    print(f"pynvml_uuid={uuid}")
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError as err:
        print(f"pynvml_mig_mode=error {err}")
        continue
    print(f"pynvml_mig_mode={current}")
pynvml.nvmlShutdown()
