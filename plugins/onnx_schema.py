"""Schemas of the com.microsoft contrib ops our plugins lower to.

onnxscript needs an op's schema before it can emit it, and onnx ships none for onnxruntime's com.microsoft domain,
so each plugin declares the part of its op's schema it uses (onnxruntime itself knows the full one)."""

from __future__ import annotations


def register_contrib_op(
    name: str,
    inputs: list[str],
    outputs: list[str],
    types: dict[str, list[str]],
    attributes: dict[str, type],
    domain: str = "com.microsoft",
) -> None:
    """Register `domain`::`name` version 1 unless known. Parameters are "name:type", "name?:type" when
    optional; attributes map a name to int, float or str."""
    from onnx import defs

    try:
        defs.get_schema(name, 1, domain)
        return
    except defs.SchemaError:
        pass
    schema = defs.OpSchema

    def parameter(spec: str):
        label, kind = spec.split(":")
        option = schema.FormalParameterOption.Optional if label.endswith("?") else schema.FormalParameterOption.Single
        return schema.FormalParameter(label.rstrip("?"), kind, param_option=option)

    kinds = {int: schema.AttrType.INT, float: schema.AttrType.FLOAT, str: schema.AttrType.STRING}
    defs.register_schema(
        schema(
            name,
            domain,
            1,
            inputs=[parameter(p) for p in inputs],
            outputs=[parameter(p) for p in outputs],
            type_constraints=[(type_name, allowed, "") for type_name, allowed in types.items()],
            attributes=[schema.Attribute(attribute, kinds[kind], "") for attribute, kind in attributes.items()],
        )
    )
