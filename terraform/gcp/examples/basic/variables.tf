variable "project_id" {
  description = "GCP project to deploy into."
  type        = string
  default     = "spotguard-demo-project"
}

variable "region" {
  description = "Region of the bucket and the instance template."
  type        = string
  default     = "us-central1"
}

variable "image" {
  description = "Image built by `packer build ami/` (projects/<project>/global/images/family/spotguard)."
  type        = string
  default     = "projects/spotguard-demo-project/global/images/family/spotguard"
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
