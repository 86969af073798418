"""Stage programs of the bundled demo pipelines (`seed.yaml`, `omni.yaml`).

Each pipeline file names its stages as `workers.<module>:<callable>`; the code
here is plain user code behind the interface of `omni_runtime.stage_api`.
"""
