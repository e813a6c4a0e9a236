"""The artifact store: every version's bytes, content-addressed, owned by the control plane.

- store: the object store (obstore) behind one small API, chosen by URL;
- spool: an incoming version's files on local disk, hashed as written and validated;
- inspect: that validation: a PEFT LoRA folder checked without its base model (and without torch);
- sources: a load's lora_path (folder, file://, s3://) read into a spool;
- blobs: which blobs the database says to keep (reference in the version's transaction, collect after);
- controller: GET /v1/artifacts/{digest}[/{file}], what engines fetch.
"""
