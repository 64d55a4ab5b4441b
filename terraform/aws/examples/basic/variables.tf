variable "region" {
  description = "AWS region to deploy into."
  type        = string
  default     = "us-east-1"
}

variable "ami_id" {
  description = "AMI built by `packer build ami/` (printed at the end of the build)."
  type        = string
  default     = "ami-0123456789abcdef0"
}

variable "security_group_ids" {
  description = "Security groups for the GPU instances (outbound HTTPS is all the agent needs)."
  type        = list(string)
  default     = []
}

variable "controller_url" {
  description = "URL of the spotguard controller the agents report to."
  type        = string
  default     = "https://controller.internal.example:8700"
}

variable "job_tokens" {
  description = "VM token of each job's first VM (`spotguard controller --issue-token <job>` on the controller host), by job name."
  type        = map(string)
  default     = {}
  sensitive   = true
}

variable "controller_tls" {
  description = "HTTPS controller (certificate in /etc/spotguard/controller.crt and .key); false = private-network mode (plain HTTP)."
  type        = bool
  default     = true
}
