# A minimal deployment: one job on a spot GPU instance, images in a new bucket, fleet events
# routed to the controller. See docs/deploy-aws.md.
terraform {
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40.0, < 7.0.0"
    }
    tls = {
      source  = "hashicorp/tls"
      version = ">= 4.0.0, < 5.0.0"
    }
  }
}

provider "aws" {
  region = var.region
}

module "spotguard" {
  source = "../../modules/spotguard"

  name               = "spotguard-demo"
  ami_id             = var.ami_id
  instance_type      = "g6.xlarge"
  security_group_ids = var.security_group_ids
  controller_url     = var.controller_url
  job_tokens         = var.job_tokens
  controller_tls     = var.controller_tls

  jobs = {
    "train-llm" = {
      command = "cd /opt/train && exec python3 train.py --resume-from-env"
    }
  }

  tags = {
    project = "spotguard-demo"
  }
}
