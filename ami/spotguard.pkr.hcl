# spotguard GPU machine image for AWS (amazon-ebs) and GCP (googlecompute).
#
#   python -m build --wheel            # -> dist/spotguard-<version>-py3-none-any.whl
#   packer init ami/ && packer build -var wheel=dist/spotguard-0.1.0-py3-none-any.whl ami/
#   packer build -only='amazon-ebs.gpu' ...   # one cloud only
#
# Contents: Ubuntu 24.04, NVIDIA driver r580 by default (signed kernel modules: works with secure
# boot; the checkpoint API needs r570+, restore onto other GPUs r580+), CRIU >= 4.2.1 and
# spotguard's CRIU plugin (scripts/install-criu), spotguard from its wheel,
# systemd units (agent, controller, boot check), transparent huge pages setting.
# The build VMs need no GPU: the driver installs from packages; the boot check runs on GPU VMs.
packer {
  required_version = ">= 1.10.0"

  required_plugins {
    amazon = {
      source  = "github.com/hashicorp/amazon"
      version = ">= 1.3.0"
    }
    googlecompute = {
      source  = "github.com/hashicorp/googlecompute"
      version = ">= 1.1.0"
    }
  }
}

variable "wheel" {
  type        = string
  description = "Path of the spotguard wheel to install (python -m build --wheel)."
}

variable "nvidia_driver_branch" {
  type        = string
  default     = "580"
  description = "NVIDIA driver branch (server flavour, signed modules). 580 (default) or newer restores onto other GPUs (UUID remap); 570 has the checkpoint API but restores only onto the same GPUs."

  validation {
    condition     = can(regex("^[0-9]{3}$", var.nvidia_driver_branch)) && tonumber(var.nvidia_driver_branch) >= 570
    error_message = "nvidia_driver_branch must be 570 or newer (the CUDA checkpoint API)."
  }
}

variable "thp_mode" {
  type        = string
  default     = "always"
  description = "Transparent huge pages: always (checkpoint/restore measured 1.3-1.5x faster), madvise or never."

  validation {
    condition     = contains(["always", "madvise", "never"], var.thp_mode)
    error_message = "thp_mode must be always, madvise or never."
  }
}

variable "image_name" {
  type        = string
  default     = "spotguard"
  description = "Name prefix (AMI name / GCE image family)."
}

variable "aws_region" {
  type        = string
  default     = "us-east-1"
  description = "Region the AMI is built in."
}

variable "aws_build_instance_type" {
  type        = string
  default     = "m6i.xlarge"
  description = "Build VM type (no GPU needed)."
}

variable "aws_subnet_id" {
  type        = string
  default     = null
  description = "Subnet of the build VM (null = default VPC)."
}

variable "aws_kms_key_id" {
  type        = string
  default     = null
  description = "KMS key encrypting the AMI's snapshot (null = the account's default EBS key)."
}

variable "gcp_project_id" {
  type        = string
  default     = null
  description = "Project the GCE image is built in (required for the googlecompute build)."
}

variable "gcp_zone" {
  type        = string
  default     = "us-central1-a"
  description = "Zone of the build VM."
}

variable "gcp_build_machine_type" {
  type        = string
  default     = "n2-standard-4"
  description = "Build VM type (no GPU needed)."
}

locals {
  stamp = formatdate("YYYYMMDD-hhmmss", timestamp())
  env = [
    "NVIDIA_DRIVER_BRANCH=${var.nvidia_driver_branch}",
    "THP_MODE=${var.thp_mode}",
    "SPOTGUARD_WHEEL=/tmp/spotguard/${basename(var.wheel)}",
    "SPOTGUARD_FILES=/tmp/spotguard",
    "DEBIAN_FRONTEND=noninteractive",
  ]
}

source "amazon-ebs" "gpu" {
  region        = var.aws_region
  instance_type = var.aws_build_instance_type
  subnet_id     = var.aws_subnet_id
  ssh_username  = "ubuntu"
  ami_name      = "${var.image_name}-${local.stamp}"
  encrypt_boot  = true
  kms_key_id    = var.aws_kms_key_id
  ena_support   = true

  source_ami_filter {
    filters = {
      name                = "ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-*"
      root-device-type    = "ebs"
      virtualization-type = "hvm"
    }
    owners      = ["099720109477"]
    most_recent = true
  }

  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = 40
    volume_type           = "gp3"
    encrypted             = true
    delete_on_termination = true
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
  }

  tags = {
    "spotguard:image"      = "true"
    "spotguard:nvidia"     = var.nvidia_driver_branch
    "spotguard:thp"        = var.thp_mode
    "spotguard:build-time" = local.stamp
  }
}

source "googlecompute" "gpu" {
  project_id                  = var.gcp_project_id
  zone                        = var.gcp_zone
  machine_type                = var.gcp_build_machine_type
  source_image_family         = "ubuntu-2404-lts-amd64"
  source_image_project_id     = ["ubuntu-os-cloud"]
  ssh_username                = "packer"
  image_name                  = "${var.image_name}-${local.stamp}"
  image_family                = var.image_name
  disk_size                   = 40
  enable_secure_boot          = true
  enable_vtpm                 = true
  enable_integrity_monitoring = true
  image_labels = {
    spotguard-image  = "true"
    spotguard-nvidia = var.nvidia_driver_branch
  }
}

build {
  sources = ["source.amazon-ebs.gpu", "source.googlecompute.gpu"]

  provisioner "shell" {
    inline = ["mkdir -p /tmp/spotguard"]
  }

  provisioner "file" {
    sources = [
      var.wheel,
      "${path.root}/../scripts/install-criu",
      "${path.root}/../packaging/criu-plugin/spotguard_nvleftover.c",
      "${path.root}/../packaging/systemd/spotguard-agent.service",
      "${path.root}/../packaging/systemd/spotguard-controller.service",
      "${path.root}/../packaging/systemd/spotguard-doctor.service",
      "${path.root}/../packaging/spotguard.toml.example",
    ]
    destination = "/tmp/spotguard/"
  }

  provisioner "shell" {
    execute_command  = "chmod +x {{ .Path }}; sudo env {{ .Vars }} {{ .Path }}"
    environment_vars = local.env
    scripts = [
      "${path.root}/scripts/10-base.sh",
      "${path.root}/scripts/20-nvidia-driver.sh",
      "${path.root}/scripts/30-criu.sh",
      "${path.root}/scripts/40-spotguard.sh",
      "${path.root}/scripts/50-tuning.sh",
      "${path.root}/scripts/60-verify.sh",
      "${path.root}/scripts/90-cleanup.sh",
    ]
  }

  post-processor "manifest" {
    output     = "packer-manifest.json"
    strip_path = true
  }
}
