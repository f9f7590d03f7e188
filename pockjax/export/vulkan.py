"""Vulkan devices: what they can do, what an artifact assumed, and a target for this one.

IREE compiles SPIR-V for the GPU described by an `#iree_gpu.target<...>` attribute
(from `--iree-vulkan-target=NAME`, or injected into the module). At run time IREE's
Vulkan driver does not check that description against the device: a kernel compiled for
subgroups of 16 runs on a device with subgroups of 8 and returns wrong numbers without
an error (measured on Mesa's lavapipe with `valhall` and `adreno` targets). So the
runtime checks, and `host-vulkan` compiles for the local device's real capabilities.
"""
from __future__ import annotations

import dataclasses
import re

from pockjax.export.targets import ExportError

__all__ = ["DeviceCaps", "GpuTarget", "device_caps", "parse_target", "problems",
           "local_target_attr"]

# VkSubgroupFeatureFlagBits and VkShaderStageFlagBits.
_SUBGROUP_BASIC, _SUBGROUP_ARITHMETIC, _SUBGROUP_SHUFFLE = 0x1, 0x4, 0x10
_STAGE_COMPUTE = 0x20


@dataclasses.dataclass(frozen=True)
class DeviceCaps:
    """One Vulkan device, from IREE's `dump_device_info`.

    Attributes:
      name: the device name.
      api: the Vulkan API version as `(major, minor)`.
      subgroup_size: the default subgroup size.
      min_subgroup_size: the smallest subgroup size with subgroup size control.
      max_subgroup_size: the largest subgroup size with subgroup size control.
      subgroup_ops: the supported subgroup operations (`VkSubgroupFeatureFlagBits`).
      required_size_stages: the shader stages that can require a subgroup size
        (`VkShaderStageFlagBits`).
      size_control: whether the device has `subgroupSizeControl`.
      fp16: whether it has `shaderFloat16`.
      int8: whether it has `shaderInt8`.
      storage8: whether it has `storageBuffer8BitAccess`.
      storage16: whether it has `storageBuffer16BitAccess`.
      dot_product: whether it has `shaderIntegerDotProduct`.
      device_type: `VkPhysicalDeviceType` as IREE prints it (`"cpu"` for lavapipe and
        SwiftShader); empty when the device info has none.
    """

    name: str
    api: tuple[int, int]
    subgroup_size: int
    min_subgroup_size: int
    max_subgroup_size: int
    subgroup_ops: int
    required_size_stages: int
    size_control: bool
    fp16: bool
    int8: bool
    storage8: bool
    storage16: bool
    dot_product: bool
    # VkPhysicalDeviceType as IREE prints it ("cpu" for lavapipe and SwiftShader).
    device_type: str = ""

    @property
    def on_cpu(self) -> bool:
        """A Vulkan implementation that runs on the CPU: its driver compiles each
        pipeline to machine code when it is first used (seconds to minutes)."""
        return self.device_type == "cpu"

    def subgroup_sizes(self) -> list[int]:
        """The subgroup sizes a compute shader can run with on this device.

        Returns:
          Every power of two from `min_subgroup_size` to `max_subgroup_size` when the
          device can require a size for compute shaders, else `[subgroup_size]`.
        """
        if self.size_control and self.required_size_stages & _STAGE_COMPUTE:
            sizes, s = [], self.min_subgroup_size
            while s <= self.max_subgroup_size:
                sizes.append(s)
                s *= 2
            return sizes
        return [self.subgroup_size]


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """What an artifact was compiled for: the fields of `#iree_gpu.target` that matter.

    Attributes:
      arch: the GPU architecture name (`"valhall"`, `"host"`, ...).
      compute: the compute types the kernels use (`"fp32"`, `"fp16"`, `"int8"`, ...).
      storage: the storage widths they use (`"b32"`, `"b16"`, `"b8"`).
      subgroup_ops: the subgroup operations they use (`"shuffle"`, `"arithmetic"`);
        empty for none.
      dot: the integer dot-product operation (e.g. `"dp4xi8toi32"`), or None.
      subgroup_size_choices: the subgroup sizes compiled for.
      text: the attribute's full text.
    """

    arch: str
    compute: frozenset[str]
    storage: frozenset[str]
    subgroup_ops: frozenset[str]
    dot: str | None
    subgroup_size_choices: tuple[int, ...]
    text: str


def parse_target(text: str) -> GpuTarget:
    """The `#iree_gpu.target<...>` in `text` (an attribute or a whole module).

    Args:
      text: MLIR text holding the attribute.

    Returns:
      The first such attribute as a `GpuTarget`.

    Raises:
      ExportError: `text` holds no `#iree_gpu.target` attribute.
    """
    m = re.search(r"#iree_gpu\.target<.*?>>", text)
    if not m:
        raise ExportError("no #iree_gpu.target attribute found in the compiled module")
    attr = m.group(0)

    def field(name, default=""):
        f = re.search(rf"\b{name} = ([^,>]+)", attr)
        return f.group(1).strip().strip('"') if f else default

    sizes = re.search(r"subgroup_size_choices = \[([\d, ]+)\]", attr)
    flags = lambda v: frozenset(x for x in v.split("|") if x and x != "none")
    return GpuTarget(arch=field("arch"), compute=flags(field("compute")),
                     storage=flags(field("storage")), subgroup_ops=flags(field("subgroup")),
                     dot=field("dot") or None,
                     subgroup_size_choices=tuple(int(s) for s in sizes.group(1).split(","))
                     if sizes else (), text=attr)


def _driver_device(index: int):
    import iree.runtime as ir

    try:
        driver = ir.get_driver("vulkan")
        devices = driver.query_available_devices()
    except Exception as e:
        raise ExportError(f"no Vulkan driver here ({e}); on Debian/Ubuntu install "
                          "mesa-vulkan-drivers for the CPU implementation (lavapipe)") from None
    if not devices:
        raise ExportError("the Vulkan driver found no device; on Debian/Ubuntu install "
                          "mesa-vulkan-drivers for the CPU implementation (lavapipe)")
    if index >= len(devices):
        raise ExportError(f"Vulkan device {index} does not exist; there are {len(devices)}")
    return driver, devices[index]


def device_caps(index: int = 0) -> DeviceCaps:
    """The capabilities of Vulkan device `index` (the one `get_device("vulkan")` opens
    for index 0).

    Args:
      index: the device's position in the Vulkan driver's list of devices.

    Returns:
      The device's `DeviceCaps`.

    Raises:
      ExportError: there is no Vulkan driver or device, no device `index`, or the
        device info lacks a line it needs.
    """
    driver, dev = _driver_device(index)
    info = driver.dump_device_info(dev["device_id"])
    return caps_from_info(info)


def caps_from_info(info: str) -> DeviceCaps:
    """DeviceCaps from the text of IREE's `dump_device_info` (or `iree-run-module
    --dump_devices=vulkan` run on the device).

    Args:
      info: the device info text.

    Returns:
      The device's `DeviceCaps`.

    Raises:
      ExportError: `info` lacks a `name:`, `api:`, `features:` or `subgroup:` line.
    """
    def line(key):
        m = re.search(rf"^{key}: (.*)$", info, re.M)
        if not m:
            raise ExportError(f"Vulkan device info has no '{key}:' line:\n{info[:400]}")
        return m.group(1)

    feats = dict(re.findall(r"(\w+)=(yes|no)", line("features")))
    sub = dict(re.findall(r"(\w+)=(0x[0-9a-fA-F]+|\d+)", line("subgroup")))
    num = lambda k: int(sub[k], 0)
    api = tuple(int(x) for x in line("api").split(".")[:2])
    yes = lambda k: feats.get(k) == "yes"
    kind = re.search(r"^type: (.*)$", info, re.M)
    return DeviceCaps(name=line("name").strip(), api=api, subgroup_size=num("size"),
                      min_subgroup_size=num("minSubgroupSize"),
                      max_subgroup_size=num("maxSubgroupSize"), subgroup_ops=num("operations"),
                      required_size_stages=num("requiredSubgroupSizeStages"),
                      size_control=yes("subgroupSizeControl"), fp16=yes("shaderFloat16"),
                      int8=yes("shaderInt8"), storage8=yes("storageBuffer8BitAccess"),
                      storage16=yes("storageBuffer16BitAccess"),
                      dot_product=yes("shaderIntegerDotProduct"),
                      device_type=kind.group(1).strip() if kind else "")


def problems(target: GpuTarget, caps: DeviceCaps) -> list[str]:
    """What `target` assumes that the device does not have (empty if it fits).

    Compares the subgroup sizes and operations (where the target uses subgroup
    operations), fp16 and int8 arithmetic, 8- and 16-bit storage and the integer dot
    product.

    Args:
      target: what the artifact was compiled for (`parse_target`).
      caps: the device (`device_caps`).

    Returns:
      One line per mismatch; empty when the device has everything `target` assumes.
    """
    out = []
    if target.subgroup_ops:
        sizes = caps.subgroup_sizes()
        if not any(s in sizes for s in target.subgroup_size_choices):
            out.append(f"subgroup size: compiled for {list(target.subgroup_size_choices)}, "
                       f"the device runs {' or '.join(map(str, sizes))}")
        need = _SUBGROUP_BASIC
        need |= _SUBGROUP_ARITHMETIC if "arithmetic" in target.subgroup_ops else 0
        need |= _SUBGROUP_SHUFFLE if "shuffle" in target.subgroup_ops else 0
        if caps.subgroup_ops & need != need:
            out.append(f"subgroup operations: compiled for {'|'.join(sorted(target.subgroup_ops))}, "
                       f"the device has operation bits {caps.subgroup_ops:#x}")
    for flag, ok, feature in (("fp16", caps.fp16, "shaderFloat16"), ("int8", caps.int8, "shaderInt8")):
        if flag in target.compute and not ok:
            out.append(f"{flag} arithmetic: the device lacks {feature}")
    for flag, ok, feature in (("b8", caps.storage8, "storageBuffer8BitAccess"),
                              ("b16", caps.storage16, "storageBuffer16BitAccess")):
        if flag in target.storage and not ok:
            out.append(f"{flag} storage: the device lacks {feature}")
    if target.dot and not caps.dot_product:
        out.append(f"integer dot product ({target.dot}): the device lacks shaderIntegerDotProduct")
    return out


def local_target_attr(caps: DeviceCaps) -> str:
    """A `#hal.device.target` for this device's real capabilities.

    Workgroup limits are the minimums every Vulkan implementation must support, so the
    kernels never ask for more than the device has; only the features and the subgroup
    size come from the device.

    Args:
      caps: the device (`device_caps`).

    Returns:
      The attribute as MLIR text, to put in the module's `hal.device.targets`.
    """
    spirv = {(1, 0): "1.0", (1, 1): "1.3", (1, 2): "1.5"}.get(caps.api, "1.6")
    compute = ["fp32", "int32"] + (["fp16"] if caps.fp16 else []) + (["int8"] if caps.int8 else [])
    storage = ["b32"] + (["b16"] if caps.storage16 else []) + (["b8"] if caps.storage8 else [])
    need = _SUBGROUP_BASIC | _SUBGROUP_ARITHMETIC | _SUBGROUP_SHUFFLE
    subgroup = "shuffle|arithmetic" if caps.subgroup_ops & need == need else "none"
    dot = ", dot = dp4xi8toi32" if caps.dot_product and caps.int8 else ""
    return ('#hal.device.target<"vulkan", [#hal.executable.target<"vulkan-spirv", '
            '"vulkan-spirv-fb", {iree_codegen.target_info = #iree_gpu.target<arch = "host", '
            f'features = "spirv:v{spirv},cap:Shader", wgp = <compute = {"|".join(compute)}, '
            f'storage = {"|".join(storage)}, subgroup = {subgroup}{dot}, '
            f'subgroup_size_choices = [{caps.subgroup_size}], '
            "max_workgroup_sizes = [128, 128, 64], max_thread_count_per_workgroup = 128, "
            "max_workgroup_memory_bytes = 16384, max_workgroup_counts = [65535, 65535, 65535]>>}>]>"
            " : !hal.device")
