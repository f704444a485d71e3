"""vllm.lora.request.LoRARequest as ibpo constructs it: (name, positive int id, path)."""


class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path=""):
        if lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {lora_int_id}")
        assert lora_path, "lora_path cannot be empty"
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path
