"""The profile's pod patch (kubernetes.pod_patch): a strategic-merge patch on every pod the harness renders, so that
what no setting says (a volume, an env variable, hostIPC, a label) reaches the pods without editing the YAML by hand,
which would lose preflight, the watcher and collection (`harness run` submits its own rendering).

The merge follows Kubernetes' strategic-merge-patch rules for a pod (k8s.io/api core/v1 types.go, each list field's
`patchStrategy:"merge" patchMergeKey:...`; kubectl patch's documentation): mappings merge key by key and a null removes
a key; the lists below merge item by item on their merge key (an item whose key is new is added, one whose key is
there is merged into it); every other list is replaced whole (tolerations and args among them, as Kubernetes does).
The directives `$patch: delete` (on a list item: remove it; on a mapping: remove the field) and `$patch: replace` (on
a list item: the list becomes the patch's other items; on a mapping: it replaces the mapping whole) are supported;
`$setElementOrder` and `$deleteFromPrimitiveList` are not.

One patch fits every pod: its container entries name containers, and the training container answers to either
name it has (`pytorch` in a PyTorchJob and the health job, `node` in a TrainJob). A container the pod lacks is a
sidecar added to the training and health pods (it needs an image) and left out of the harness's own small pods (the
watcher, the collector), whose one container the harness runs and reads. A patch that would change what the harness
manages (the training container's command, args and image, its results volume mount, the restart policy, the labels
it selects pods by) is refused in one line naming the field.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from types import SimpleNamespace

from kubernetes import client as k8s

from harness.errors import HarnessError

SETTING = "kubernetes.pod_patch"
# The pod's lists that Kubernetes merges, by their merge key (patchMergeKey); each name means one list in a pod.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
              "env": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "ports": "containerPort",
              "imagePullSecrets": "name", "hostAliases": "ip", "resourceClaims": "name",
              "topologySpreadConstraints": "topologyKey"}
TRAINING_NAMES = ("pytorch", "node")  # the training container's names: PyTorchJob's, TrainJob's
DIRECTIVE = "$patch"


def merge(base, patch, field: str | None = None):
    """`base` (not modified) with the strategic-merge `patch` applied (see the module's notes)."""
    if isinstance(patch, dict):
        directive = patch.get(DIRECTIVE)
        body = {key: value for key, value in patch.items() if key != DIRECTIVE}
        if directive == "replace":
            return copy.deepcopy(body)
        if directive is not None:
            raise HarnessError(f"{SETTING}: {DIRECTIVE}: {directive!r} on {field or 'the patch'} is not supported; "
                               "valid: replace (and delete, on a list item or a field)")
        merged = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in body.items():
            if value is None or (isinstance(value, dict) and value.get(DIRECTIVE) == "delete"):
                merged.pop(key, None)
            else:
                merged[key] = merge(merged.get(key), value, key)
        return merged
    if isinstance(patch, list) and field in MERGE_KEYS and isinstance(base, list):
        return _merge_list(base, patch, field, MERGE_KEYS[field])
    return copy.deepcopy(patch)


def _merge_list(base: list, patch: list, field: str, key: str) -> list:
    if any(isinstance(item, dict) and item.get(DIRECTIVE) == "replace" for item in patch):
        return [copy.deepcopy(item) for item in patch if not (isinstance(item, dict) and item.get(DIRECTIVE))]
    merged = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise HarnessError(f"{SETTING}: each item of {field} needs its {key} (the key Kubernetes merges it by), "
                               f"got {item!r}")
        at = next((i for i, old in enumerate(merged) if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get(DIRECTIVE) == "delete":
            if at is not None:
                merged.pop(at)
        elif at is None:
            merged.append(merge(None, item, field))
        else:
            merged[at] = merge(merged[at], item, field)
    return merged


@dataclass(frozen=True)
class Target:
    """What the harness manages in one kind of pod, which no patch may change."""

    container: str  # the container the harness runs and reads logs from
    results_mount: str | None  # where that container mounts the results volume
    sidecars: bool  # whether a container the pod lacks is added (training and health pods) or left out


def _check_shape(patch: dict) -> None:
    """The patch's own shape: a pod template's metadata (labels, annotations) and spec."""
    unknown = sorted(set(patch) - {"metadata", "spec"})
    if unknown:
        raise HarnessError(f"{SETTING}: unknown key(s) {', '.join(unknown)}; valid: metadata, spec (as in a pod "
                           "template)")
    metadata = patch.get("metadata") or {}
    if not isinstance(metadata, dict) or set(metadata) - {"labels", "annotations"}:
        raise HarnessError(f"{SETTING}: metadata may hold labels and annotations only (the harness names its pods), "
                           f"got {metadata!r}")
    if not isinstance(patch.get("spec") or {}, dict):
        raise HarnessError(f"{SETTING}: spec must be a mapping, as in a pod template")


def apply(template: dict, patch: dict, target: Target) -> dict:
    """A pod template (or pod: metadata and spec) with the patch applied for this kind of pod; refused in one line
    where the patch would change what the harness manages there."""
    if not patch:
        return template
    _check_shape(patch)
    patch = _for_pod(patch, template, target)
    patched = merge(template, patch)
    before, after = _managed(template, target), _managed(patched, target)
    for field, value in before.items():
        if after.get(field) != value:
            raise HarnessError(f"{SETTING} would change {field}, which the harness manages (preflight, the watcher "
                               f"and collection rely on it): leave it out of the patch")
    return patched


def _for_pod(patch: dict, template: dict, target: Target) -> dict:
    """The patch as it applies to this pod: entries for the training container renamed to its name here; entries
    for a container the pod lacks left out of the harness's own pods, and refused in the others without an image
    (a typo, or a container of the other API)."""
    spec = patch.get("spec") or {}
    pod = template.get("spec") or {}
    adapted = dict(spec)
    for field in ("containers", "initContainers"):
        if not isinstance(spec.get(field), list):
            continue
        names = {c.get("name") for c in pod.get(field) or []}
        entries = []
        for entry in spec[field]:
            if not isinstance(entry, dict):
                raise HarnessError(f"{SETTING}: each item of spec.{field} must be a mapping, got {entry!r}")
            if field == "containers" and entry.get("name") in TRAINING_NAMES and target.container in TRAINING_NAMES:
                entry = {**entry, "name": target.container}
            if entry.get("name") in names or entry.get(DIRECTIVE) == "replace":
                entries.append(entry)
            elif target.sidecars:
                if "image" not in entry and entry.get(DIRECTIVE) != "delete":
                    raise HarnessError(f"{SETTING}: spec.{field} names {entry.get('name')!r}, which the training pods "
                                       f"do not have (theirs: {', '.join(sorted(names)) or 'none'}; the training "
                                       f"container answers to {' or '.join(TRAINING_NAMES)}); a new container needs "
                                       "an image")
                entries.append(entry)
        adapted[field] = entries
    return {**patch, "spec": adapted}


def _managed(template: dict, target: Target) -> dict[str, object]:
    """The fields of a pod that the harness manages, by their path in the pod."""
    spec, labels = template.get("spec") or {}, (template.get("metadata") or {}).get("labels") or {}
    main = next((c for c in spec.get("containers") or [] if c.get("name") == target.container), None) or {}
    at = f"spec.containers[{target.container}]"
    fields: dict[str, object] = {"spec.restartPolicy": spec.get("restartPolicy"), at: bool(main),
                                 f"{at}.command": main.get("command"), f"{at}.args": main.get("args"),
                                 f"{at}.image": main.get("image")}
    if target.results_mount:
        mount = next((m for m in main.get("volumeMounts") or [] if m.get("mountPath") == target.results_mount), None)
        fields[f"{at}.volumeMounts[{target.results_mount}]"] = mount
        name = (mount or {}).get("name")
        fields[f"spec.volumes[{name}]"] = next((v for v in spec.get("volumes") or [] if v.get("name") == name), None)
    fields.update({f"metadata.labels[{key}]": value for key, value in labels.items()})
    return fields


def check_pod_fields(pod: dict, model: str = "V1PodTemplateSpec") -> dict:
    """`pod` as the client's model (V1PodTemplateSpec, V1Pod) reads it back: a field the Pod API does not have, or a
    value of another type, which the API server would drop or refuse, is named in one line."""
    where = first_difference(pod, read_back(pod, model, SETTING))
    if where:
        raise HarnessError(f"{SETTING}: {where} is not a pod field of that name and type (Kubernetes' Pod API)")
    return pod


def read_back(value: dict, model: str, setting: str) -> dict:
    """`value` read by the client's own model `model` and written again, as the client would send it; a value the
    model refuses (a required field missing) is one line naming the setting."""
    api = k8s.ApiClient()
    try:
        return api.sanitize_for_serialization(api.deserialize(SimpleNamespace(data=json.dumps(value)), model))
    except (ValueError, TypeError) as exc:
        raise HarnessError(f"{setting}: not a valid {model.removeprefix('V1')}: {exc}".replace("\n", " ")) from None


def first_difference(given, read_back, path: str = "") -> str | None:
    """The path of the first value in `given` that `read_back` does not hold as it is."""
    if isinstance(given, dict) and isinstance(read_back, dict):
        for key, value in given.items():
            found = first_difference(value, read_back.get(key, _MISSING), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(given, list) and isinstance(read_back, list) and len(given) == len(read_back):
        for i, (value, back) in enumerate(zip(given, read_back)):
            found = first_difference(value, back, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(given, (int, float)) and not isinstance(given, bool) and read_back == str(given):
        return None  # a quantity or an int-or-string port written as a number, which the API server takes
    return None if given == read_back and type(given) is type(read_back) else path or "the patch"


_MISSING = object()
